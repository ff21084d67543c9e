//! Every Lua script the crate sends, with its SHA1 computed once.
//!
//! Both scripts take any number of keys (`KEYS[i]` with token `ARGV[i+1]`)
//! and answer one integer per key: `1` done, `0` key absent, `-1` key held by
//! another token. The watchdog uses the same scripts to renew many locks in
//! one round trip.

use std::sync::LazyLock;

/// Compare-and-delete. `ARGV[1]` is unused (kept so both scripts share one
/// argument layout).
pub(crate) static RELEASE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(RELEASE_LUA));

/// Source of [`RELEASE`].
pub(crate) const RELEASE_LUA: &str = r"local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v == ARGV[i + 1] then
    out[i] = redis.call('DEL', key)
  elseif v then
    out[i] = -1
  else
    out[i] = 0
  end
end
return out";

/// Compare-and-pexpire to `ARGV[1]` milliseconds.
pub(crate) static EXTEND: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(EXTEND_LUA));

/// Source of [`EXTEND`].
pub(crate) const EXTEND_LUA: &str = r"local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v == ARGV[i + 1] then
    out[i] = redis.call('PEXPIRE', key, ARGV[1])
  elseif v then
    out[i] = -1
  else
    out[i] = 0
  end
end
return out";
