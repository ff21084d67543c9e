//! The Lua fragments the scripts of [`super`] share, as macros that expand
//! to string literals (`concat!`), so that each script stays one constant
//! with its SHA1 computed once.

/// The head of [`ACQUIRE_LUA`](super::ACQUIRE_LUA): the node's lock
/// history, read and updated, and the reply's first five elements: `epoch`,
/// `age`, `max_ttl`, `prev_max` and `after` (see `raise_lua!`). One `TIME`
/// and one `HMGET`; an `HSET` only when the history begins or the longest
/// TTL grows.
macro_rules! history_lua {
    () => {
        concat!(
            r"local meta = KEYS[#KEYS]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = redis.call('HMGET', meta, 'epoch', 'max_ttl', 'prev_max', 'after')
local epoch = tonumber(m[1])
if not epoch or epoch > now + 1 then
  epoch = now + 1
  redis.call('HSET', meta, 'epoch', epoch)
end
local age = math.max(now - epoch, 0)
local known = tonumber(m[2]) or 0
local prev = tonumber(m[3]) or known
local after = m[4] or ''
",
            raise_lua!(),
            r"local out = {epoch, age, known, prev, after}
local n = #KEYS - 1
"
        )
    };
}

/// Records the TTL a command uses, `ARGV[1]`, in the node's history
/// (`meta`, its longest TTL so far `known`), with `ARGV[2]`: the longest
/// TTL the client knew of before this command, then `;` and lock-history
/// keys (comma-separated), then, where those keys are not for a first use,
/// `;` and a TTL. Where the client uses a TTL longer than any it knows of,
/// the keys are the histories it knew to have begun; a TTL longer than
/// both is first used now: recorded with `prev_max`, the longest before
/// it, and `after`, those histories. Only histories in `after` can count
/// that TTL as first used after they began; none (empty): in use since
/// always. A longer TTL only the client knew of was in use elsewhere: it
/// comes with the histories it was first used after and the longest TTL
/// before it, as the client knows them, and is recorded so, the longest
/// before never below the node's own longest so far (without histories:
/// in use since always). Each key names a history that had begun before
/// the record is written (see `crate::lock::engine`'s `first_use`).
macro_rules! raise_lua {
    () => {
        r"local ttl = tonumber(ARGV[1])
local gossip = tonumber(string.match(ARGV[2], '^%d+')) or 0
local begun = string.match(ARGV[2], '^%d*;([%d,]*)') or ''
local base = math.max(known, gossip)
if ttl > base then
  redis.call('HSET', meta, 'max_ttl', ttl, 'prev_max', base, 'after', begun)
elseif gossip > known then
  local before = gossip
  if begun ~= '' then
    before = math.max(tonumber(string.match(ARGV[2], '^%d*;[%d,]*;(%d+)$')) or gossip, known)
  end
  redis.call('HSET', meta, 'max_ttl', gossip, 'prev_max', before, 'after', begun)
end
"
    };
}

/// `ours(v, t)`: whether value `v` is token `t` or, for a handed-over
/// lock's token `L.S`, any token of the same lineage (`L` or `L.*`). A
/// value that is no string (a reader set, see `readers_lua!`) is nobody's
/// token.
macro_rules! ours_lua {
    () => {
        r"local function ours(v, t)
  if type(v) ~= 'string' then return false end
  if v == t then return true end
  local dot = string.find(t, '.', 1, true)
  if not dot then return false end
  return v == string.sub(t, 1, dot - 1) or string.sub(v, 1, dot) == string.sub(t, 1, dot)
end
"
    };
}

/// Read locks. A reader's token begins with `r` (byte 114; a writer's is
/// hex, see [`crate::algorithm::round::is_reader`]). A resource that
/// readers hold is a sorted set of their tokens, each scored by its expiry
/// (the node's time in ms), and perhaps `w`, the waiting writers' intent,
/// scored likewise: the key lives as long as its last entry, and an entry
/// counts only until its score. A writer's key (a string) and a live
/// reader's entry are never on one node at once.
///
/// A reader set is the crate's own only with its mark, the member
/// [`READERS_MARK`](super::READERS_MARK) scored `0`, written when the set
/// is made: any other sorted set (or any key of another type) under a
/// lock's name is an application's, never read as readers, never changed.
/// Expired entries are dropped by score from just above `0` (the mark
/// stays); the set is deleted when only its mark is left.
///
/// Declares the helpers, which `make_readers_lua!` makes (once, where a
/// script first needs them: a closure costs the node about 0.2 µs, and
/// the common writer's rounds need none): `value(k)`: `false` (absent),
/// `true` (our reader set), `0` (another owner's key that is no string:
/// an application's) or the string stored (a writer's token, or an
/// application's string); `own_set(k)`: `true` (our reader set), `false`
/// (absent) or `0` (anything else), with the commands of the lock's ACL
/// (`GET`, not `EXISTS`; a refusal of `ZSCORE` other than `WRONGTYPE`, an
/// ACL's, is the script's error, never taken for an application's key);
/// `ms_now()`: the node's time in ms (`clock_ms`, read once); `live(k)`:
/// the live readers of our reader set `k` (expired entries dropped);
/// `enter(k, m, ms)`: entry `m` of our
/// reader set `k` (made, with its mark, where absent) lives at least `ms`
/// more, and the key with it; `last_entry(k)`: the key lives exactly as
/// long as its last entry, and goes where only its mark is left.
macro_rules! readers_lua {
    () => {
        r"local clock_ms, value, own_set, ms_now, live, enter, last_entry
"
    };
}

/// Makes the helpers `readers_lua!` declares, where none is yet: pasted
/// where a script meets a reader's key, so that a writer's round makes no
/// closure (and captures no upvalue: each costs the node an allocation).
macro_rules! make_readers_lua {
    () => {
        r"if not value then
  own_set = function(k)
    local s = redis.pcall('ZSCORE', k, '\0quorumlock')
    if s == '0' then return true end
    if type(s) == 'table' and not string.find(s.err or '', 'WRONGTYPE', 1, true) then
      -- Refused (an ACL without it): the script's error, as any command's.
      redis.call('ZSCORE', k, '\0quorumlock')
    end
    if redis.pcall('GET', k) then return 0 end
    return false
  end
  value = function(k)
    local v = redis.pcall('GET', k)
    if type(v) == 'table' then return own_set(k) end
    return v
  end
  ms_now = function()
    if not clock_ms then
      local c = redis.call('TIME')
      clock_ms = tonumber(c[1]) * 1000 + math.floor(tonumber(c[2]) / 1000)
    end
    return clock_ms
  end
  live = function(k)
    redis.call('ZREMRANGEBYSCORE', k, '(0', ms_now())
    local c = redis.call('ZCARD', k) - 1
    if redis.call('ZSCORE', k, 'w') then c = c - 1 end
    return c
  end
  enter = function(k, m, ms)
    local at = ms_now() + ms
    local s = tonumber(redis.call('ZSCORE', k, m))
    if not s or s < at then redis.call('ZADD', k, 0, '\0quorumlock', at, m) end
    if redis.call('PTTL', k) < ms then redis.call('PEXPIRE', k, ms) end
  end
  last_entry = function(k)
    local top = redis.call('ZREVRANGE', k, 0, 0, 'WITHSCORES')
    if top[1] == '\0quorumlock' then
      redis.call('DEL', k)
    elseif top[2] then
      redis.call('PEXPIRE', k, math.max(tonumber(top[2]) - ms_now(), 1))
    end
  end
end
"
    };
}

/// A writer's view of `$key` into local `$v`: as `value` (see
/// `readers_lua!`), inline (no helper made on a writer's round).
macro_rules! writer_view_lua {
    ($v:literal, $key:literal) => {
        concat!(
            "local ",
            $v,
            " = redis.pcall('GET', ",
            $key,
            ")\n",
            "if type(",
            $v,
            ") == 'table' then ",
            $v,
            " = true end\n"
        )
    };
}

/// The loop shared by the scripts that act on keys holding exactly our
/// token (`KEYS[i]`, token `ARGV[i + $tok]`, [`META_KEY`](super::META_KEY) last): runs `$own`
/// where the key is ours (it sets `out[i]`), answers `-1` (another owner,
/// or readers) elsewhere, and runs `$absent` where the key does not exist (it sets
/// `out[i]`); returns `out`.
macro_rules! each_own_key_lua {
    ($tok:literal, $own:expr, $absent:expr) => {
        concat!(
            r"for i = 1, #KEYS - 1 do
  local key = KEYS[i]
  local v = redis.pcall('GET', key)
  if v == ARGV[i + ",
            $tok,
            r"] then
",
            $own,
            r"  elseif v then
    out[i] = -1
  else
",
            $absent,
            r"  end
end
return out"
        )
    };
}

/// An acquire's answer for key `$k`, just set, into `$out`: 1, or (fenced)
/// its counter moved on to `max(counter + 1, micros)`. Inline: a helper
/// would cost every acquire a closure and its upvalues.
macro_rules! granted_lua {
    ($k:literal, $out:literal) => {
        concat!(
            "if fenced then\n",
            "  local f = 'fence:' .. ",
            $k,
            "\n",
            "  local c = math.max((tonumber(redis.call('HGET', meta, f)) or 0) + 1, micros)\n",
            "  redis.call('HSET', meta, f, string.format('%.0f', c))\n",
            "  ",
            $out,
            " = c\n",
            "else\n",
            "  ",
            $out,
            " = 1\n",
            "end\n"
        )
    };
}

/// An acquire's answer for key `$k`, held by another owner, into `$out`:
/// how long it still holds it, for the waiter's fallback (`-1 - ms`; 0
/// where the key never expires or an ACL refuses `PTTL`). Inline, as
/// `granted_lua!`.
macro_rules! held_lua {
    ($k:literal, $out:literal) => {
        concat!(
            "do\n",
            "  local left = redis.pcall('PTTL', ",
            $k,
            ")\n",
            "  if type(left) ~= 'number' or left == -1 then ",
            $out,
            " = 0\n",
            "  else ",
            $out,
            " = -1 - math.max(left, 0) end\n",
            "end\n"
        )
    };
}
