//! Every Lua script the crate sends, with its SHA1 computed once.
//!
//! Release and extend take any number of keys (`KEYS[i]` with token
//! `ARGV[i+1]`) and answer one integer per key: `1` done, `0` key absent,
//! `-1` key held by another token. The watchdog uses the same scripts to
//! renew many locks in one round trip.

use std::sync::LazyLock;

// The Lua fragments the scripts share (`history_lua!`, `raise_lua!`,
// `granted_lua!`, `held_lua!`, `ours_lua!`, `readers_lua!`,
// `make_readers_lua!`, `writer_view_lua!`, `each_own_key_lua!`).
#[macro_use]
mod lua;

pub(crate) use crate::algorithm::round::META_KEY;

/// The member that marks a sorted set as a reader set of this crate (see
/// `readers_lua!`; written out as `'\0quorumlock'` in the scripts), scored
/// `0`: a key without it is an application's.
pub(crate) const READERS_MARK: &str = "\0quorumlock";

/// `SET NX PX` for every lock key, plus the node's lock history. `KEYS` are
/// the lock keys then [`META_KEY`]; `ARGV[1]` the TTL in ms, `ARGV[2]` the
/// longest TTL the client knew of before this command (and, for a first
/// use, the lock histories it knows: see `raise_lua!`), `ARGV[3]` the mode:
/// `1` for a fenced lock, plus twice the writers' intent in ms (`0`:
/// unfenced, no intent; see [`ACQUIRE_LUA`]), for a waiting writer followed
/// by `;order;claim_ms;mask` (its place: see
/// [`Place`](crate::algorithm::round::Place)), `ARGV[4..]` the tokens. Answers `{epoch, age_ms,
/// max_ttl, prev_max, after, r1, …}`: the node's history before this
/// command (see `history_lua!`), then `ri`: where held by another owner,
/// `-1 - PTTL` (0 where it never expires, or where the ACL refuses
/// `PTTL`: a `pcall`); where set, 1 or (fenced) the key's new fencing
/// counter (see [`ACQUIRE_LUA`]). The keys of one round are one lock (a
/// round acquires one): with several, all are set or none is.
/// The epoch is rounded up and the current time down, so that the age is
/// never more than the time the node has really kept its data; an epoch in
/// the node's future (its clock was stepped back) starts again now.
///
/// What the script no longer does on every call, the connection knows
/// once: the server's `run_id` and uptime, from the `INFO` it reads at
/// connect and every few seconds (a restart always breaks connections).
/// The client caps the age at that uptime (a node restarted from a
/// snapshot or an AOF kept its history but may have lost its latest
/// locks) and derives the history's key from the `run_id` and the epoch
/// (see [`crate::algorithm::round::NodeFacts::seen_by`]).
pub(crate) static ACQUIRE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(ACQUIRE_LUA));

pub(crate) use crate::algorithm::round::FENCE_LIMIT;

/// The channel a release publishes a freed key on is this prefix and the
/// key (written out in [`RELEASE_LUA`]).
pub(crate) const FREED_PREFIX: &str = "quorumlock:free:";

/// Source of [`ACQUIRE`]. A resource's fencing counter is the field
/// `fence:<resource>` of [`META_KEY`], so that counters disappear exactly
/// with the lock history (a node that lost its data is held back, and its
/// counters start again from its clock). A fenced SET moves the counter to
/// `max(counter + 1, node time in µs)`: it never goes backwards, not even
/// on a node that lost its data (the floor is the node's clock), and never
/// passes [`FENCE_LIMIT`] (the script refuses first, before any SET).
///
/// A reader's token (one key, never fenced) enters the key's reader set
/// (see `readers_lua!`) unless a writer holds the key (answered as any
/// owner) or the writers' intent is on it (answered `0`: no end known).
/// A writer takes a reader set with no live reader left (expired entries
/// and the intent go with it); where readers live it answers how long the
/// last one has left, and, with an intent in the mode (ms, `0`: none) it gets
/// at least that long: a waiting writer keeps new readers out.
///
/// A set that another key keeps out, with a place and `claim_ms` above
/// zero, claims its free keys that `mask` names (and renews its own
/// claims): the key's value becomes `'\0claim:' .. order` for `claim_ms`
/// (answered as free: `-1`). With `claim_ms` zero its own claims go, each
/// published as a release is. A claim of the set's own, or of a set whose
/// order is later, is no obstacle to the set; a lone writer whose order
/// (its call's start) is earlier than a claim's takes the claimed key as a
/// free one. No token begins with a NUL, and a claim is only ever written
/// on a free key.
pub(crate) const ACQUIRE_LUA: &str = concat!(
    history_lua!(),
    r"local micros = tonumber(t[1]) * 1000000 + tonumber(t[2])
local mode = tonumber(ARGV[3]) or tonumber(string.match(ARGV[3], '^%d+')) or 0
local fenced = mode % 2 == 1
local life = math.floor(mode / 2)
-- A waiting call's place, how long a set's claims live and which keys it
-- claims where free (see `Place`); and `claim(k, v)`: whether `v`, under
-- `k`, is a set's claim (its shape, with a TTL: an application's string
-- without one never is).
-- (Made only for a call with a place: a closure costs every round.)
local order, claim_ms, claims, claim
if string.find(ARGV[3], ';', 1, true) then
  order, claim_ms, claims = string.match(ARGV[3], ';(%x+);(%d+);([01]*)$')
  claim = function(k, v)
    return type(v) == 'string' and #v == 35 and string.sub(v, 1, 7) == '\0claim:'
      and string.find(v, '^%x+$', 8) ~= nil and redis.call('PTTL', k) > 0
  end
end
claim_ms = tonumber(claim_ms) or 0
if fenced then
  if micros >= 9007199254740991 - 1099511627776 then
    return redis.error_reply('ERR quorumlock: the node clock is past the year 2255; fencing tokens must stay below 2^53')
  end
  for i = 1, n do
    if (tonumber(redis.call('HGET', meta, 'fence:' .. KEYS[i])) or 0) >= 9007199254740991 then
      return redis.error_reply('ERR quorumlock: this resource\'s fencing counter is at its limit, 2^53 - 1')
    end
  end
end
-- The common cases first, before anything else is made: one writer's key,
-- free, or held by another writer.
local single = n == 1 and string.byte(ARGV[4], 1) ~= 114
if single then
  if redis.call('SET', KEYS[1], ARGV[4], 'NX', 'PX', ARGV[1]) then
",
    granted_lua!("KEYS[1]", "out[6]"),
    r"    return out
  end
  local v = redis.pcall('GET', KEYS[1])
  if order and claim(KEYS[1], v) and string.sub(v, 8, 19) > order then
    -- A set's claim gives way to a call that began before the set's.
    redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[1])
",
    granted_lua!("KEYS[1]", "out[6]"),
    r"    return out
  end
  if type(v) ~= 'table' and v ~= ARGV[4] then
",
    held_lua!("KEYS[1]", "out[6]"),
    r"    return out
  end
end
",
    readers_lua!(),
    make_readers_lua!(),
    r"clock_ms = now
if string.byte(ARGV[4], 1) == 114 then
  local k, tok = KEYS[1], ARGV[4]
  local v = value(k)
  if not v then
    -- The first reader (the common case: two commands), with the mark.
    redis.call('ZADD', k, 0, '\0quorumlock', now + ttl, tok)
    redis.call('PEXPIRE', k, ttl)
    out[6] = 1
    return out
  elseif v == true then
    live(k)
    -- (This attempt's own entry, sent again: set.)
    if redis.call('ZSCORE', k, tok) then out[6] = 1 return out end
    if redis.call('ZSCORE', k, 'w') then out[6] = 0 return out end
  elseif v then
",
    held_lua!("k", "out[6]"),
    r"    return out
  end
  enter(k, tok, ttl)
  out[6] = 1
  return out
end
-- Several keys are one lock (`request().and()`): all or nothing. Where any
-- has another owner or live readers, none is set (a free one answers as
-- held with no time left: its PTTL is -2). Where any has another owner
-- (`owned`), readers are not the only obstacle here: no intent. A claim of
-- this set, or of a set that began after it (see `Place`), is no owner.
local function yields(k, v)
  return order and #order == 28 and claim(k, v) and string.sub(v, 8) >= order
end
local taken, owned = false, false
if n > 1 then
  for i = 1, n do
    local v = value(KEYS[i])
    if v == true then
      if live(KEYS[i]) > 0 then taken = true end
    elseif v and v ~= ARGV[i + 3] and not yields(KEYS[i], v) then
      taken, owned = true, true
    end
  end
end
for i = 1, n do
  local k, tok = KEYS[i], ARGV[i + 3]
  -- (The lone writer's SET failed already.)
  local set = not taken and not single and redis.call('SET', k, tok, 'NX', 'PX', ARGV[1])
  local v, mine = false, false
  if not set then
    v = value(k)
    if v == true and not taken and live(k) == 0 then
      -- Readers all gone: the intent is served, the set goes.
      redis.call('DEL', k)
      set = redis.call('SET', k, tok, 'NX', 'PX', ARGV[1])
    elseif not single and yields(k, v) then
      mine = string.sub(v, 8) == order
      if taken then v = false else set = redis.call('SET', k, tok, 'PX', ARGV[1]) end
    end
  end
  if set then
",
    granted_lua!("k", "out[i + 5]"),
    r"  elseif v == tok then
    -- This attempt's own SET (tokens are one per attempt), sent again after
    -- its connection closed before the reply: set, with its counter.
    if fenced then
      out[i + 5] = tonumber(redis.call('HGET', meta, 'fence:' .. k)) or 0
    else
      out[i + 5] = 1
    end
  elseif v == true then
    -- Readers: where any lives, the intent (where they are all that
    -- keeps the lock out), and when the last one's entry ends.
    local last = 0
    if live(k) > 0 then
      if life > 0 and not owned then enter(k, 'w', life) end
      local top = redis.call('ZREVRANGE', k, 0, 1, 'WITHSCORES')
      for j = 1, #top, 2 do
        if top[j] ~= 'w' then
          last = tonumber(top[j + 1]) - ms_now()
          break
        end
      end
    end
    out[i + 5] = -1 - math.max(last, 0)
  elseif not v and order and not single then
    -- A free key of a set another key keeps out: claimed while the set
    -- waits, where it waited for it; its own claim goes (and its waiters
    -- hear) when it stops.
    if claim_ms > 0 and (mine or string.sub(claims, i, i) == '1') then
      redis.call('SET', k, '\0claim:' .. order, 'PX', claim_ms)
    elseif mine then
      redis.call('DEL', k)
      -- (One notice on every node: the try's, hashed.)
      redis.pcall('PUBLISH', 'quorumlock:free:' .. k, redis.sha1hex(ARGV[i + 3]))
    end
    out[i + 5] = -1
  else
",
    held_lua!("k", "out[i + 5]"),
    r"  end
end
return out"
);

/// Sent once per connection, at connect: gives the node's metadata an `id`
/// unless it has one (`ARGV[1]`, random per connection) and answers it,
/// with the lock history's epoch (`''` where no history has begun: no
/// lock since the node was new or lost its data). The id names the
/// database (it disappears exactly when the node loses its data): two
/// entries of the node list that answer one id reach one server. The epoch
/// makes, with the `run_id` of the `INFO` read just before, the key of the
/// history (see [`crate::algorithm::round::history_key`]): a client learns
/// the lock histories that have begun before its first round, so that its
/// first use of a longer TTL counts as begun after them (see
/// `crate::lock::engine`'s `first_use`). It never begins a history: a
/// node without one answers none. Needs only the `HMGET` and `HSET` on
/// [`META_KEY`] the lock uses.
pub(crate) const HISTORY_ID_LUA: &str = r"local m = redis.call('HMGET', KEYS[1], 'id', 'epoch')
local id = m[1]
if not id then
  id = ARGV[1]
  redis.call('HSET', KEYS[1], 'id', id)
end
return {id, m[2] or ''}";

/// The packed `EVAL` of [`HISTORY_ID_LUA`] with a fresh random id.
pub(crate) fn history_id_command() -> Vec<u8> {
    redis::cmd("EVAL")
        .arg(HISTORY_ID_LUA)
        .arg(1)
        .arg(META_KEY)
        .arg(uuid::Uuid::new_v4().simple().to_string())
        .get_packed_command()
}

/// Hands a held lock to a new critical section: where `KEYS[1]` holds token
/// `ARGV[5]` or an earlier one of its lineage (a node that missed earlier
/// swaps), it gets token `ARGV[4]`, atomically, keeping its expiry
/// (`KEEPTTL` by hand, for Redis before 6), and for a fenced lock its
/// counter becomes at least `ARGV[3]`, the new section's fencing token (`0`:
/// not fenced). `KEYS[2]` is [`META_KEY`], where the TTL is recorded as
/// [`EXTEND`] records it; `ARGV[1..2]` as for [`ACQUIRE`]. Answers one
/// element: `1` (swapped), `0` (absent) or `-1` (another owner).
///
/// No `TIME` and no history head, unlike an acquire: a swap counts only
/// where the key still holds a token of our lineage, so the node kept our
/// lock since we acquired it and its vote needs no restart rule (as an
/// extension's does not); the key keeps its expiry, so no longer TTL is
/// used than the acquire recorded.
pub(crate) static SWAP: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(SWAP_LUA));

/// Source of [`SWAP`].
pub(crate) const SWAP_LUA: &str = concat!(
    ours_lua!(),
    r"local meta = KEYS[#KEYS]
local known = tonumber(redis.call('HGET', meta, 'max_ttl')) or 0
",
    raise_lua!(),
    r"local out = {}
local v = redis.pcall('GET', KEYS[1])
local left = redis.call('PTTL', KEYS[1])
out[1] = v and -1 or 0
if v == ARGV[4] then
  -- This swap, sent again after its connection closed before the reply.
  out[1] = 1
elseif left > 0 and ours(v, ARGV[5]) then
  redis.call('SET', KEYS[1], ARGV[4], 'PX', left)
  if ARGV[3] ~= '0' then
    local f = 'fence:' .. KEYS[1]
    if (tonumber(redis.call('HGET', meta, f)) or 0) < tonumber(ARGV[3]) then
      redis.call('HSET', meta, f, ARGV[3])
    end
  end
  out[1] = 1
end
return out"
);

/// A fenced lock's write-back: where `KEYS[i]` still holds exactly token
/// `ARGV[i + 1]`, its counter (in [`META_KEY`], the last key) becomes at
/// least `ARGV[1]`, the token granted. Answers as [`RELEASE`]. Because it
/// only writes where the key is ours, any later holder's `SET` on that
/// node comes after it, and its counter starts above our token. (Never
/// lower: our `SET` may have landed late, after later holders were granted
/// there, and their tokens were handed out.) An election's candidate (a
/// token with `@`) also records its term with its token, in the field
/// `term:<key>`: `Election::leader` reads the term there, where the key
/// holds that token (a node's counter may be above it).
pub(crate) static FENCE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(FENCE_LUA));

/// Source of [`FENCE`].
pub(crate) const FENCE_LUA: &str = concat!(
    r"local out = {}
local meta = KEYS[#KEYS]
",
    each_own_key_lua!(
        1,
        r"    local f = 'fence:' .. key
    if (tonumber(redis.call('HGET', meta, f)) or 0) < tonumber(ARGV[1]) then
      redis.call('HSET', meta, f, ARGV[1])
    end
    if string.find(ARGV[i + 1], '@', 1, true) then
      redis.call('HSET', meta, 'term:' .. key, ARGV[1] .. ' ' .. ARGV[i + 1])
    end
    out[i] = 1
",
        r"    out[i] = 0
"
    )
);

/// Compare-and-delete. A handed-over lock's token also deletes the earlier
/// tokens of its lineage, which a node that missed a swap may still hold.
///
/// Where `ARGV[1]` (the release's notice) is not `0`, a deleted key is
/// published on [`FREED_PREFIX`]`<key>` with the notice as the message
/// (waiters in other clients wake and try; see `crate::driver::notify`),
/// and its answer is `1 +` the number of subscribers the message reached,
/// so that the releaser knows others wait (the fairness rule). The
/// `PUBLISH` is a `pcall`: an ACL user without channel rights still
/// releases (its waiters poll).
pub(crate) static RELEASE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(RELEASE_LUA));

/// Source of [`RELEASE`]. A reader's token leaves its reader set; the
/// last live reader out frees the key for writers, and publishes it as a
/// delete does. A key that is not the crate's (see `readers_lua!`) is
/// another owner's, for readers as for writers: never changed.
pub(crate) const RELEASE_LUA: &str = concat!(
    ours_lua!(),
    readers_lua!(),
    r"local out = {}
for i, key in ipairs(KEYS) do
  local tok = ARGV[i + 1]
  local freed = false
  if string.byte(tok, 1) == 114 then
    ",
    make_readers_lua!(),
    r"    local set = own_set(key)
    local s = set == true and redis.call('ZSCORE', key, tok)
    if set == 0 then
      out[i] = -1
    elseif s then
      redis.call('ZREM', key, tok)
      out[i] = tonumber(s) > ms_now() and 1 or 0
      freed = out[i] == 1 and live(key) == 0
      last_entry(key)
    else
      out[i] = 0
    end
  else
    ",
    writer_view_lua!("v", "key"),
    r"    if ours(v, tok) then
      out[i] = redis.call('DEL', key)
      freed = true
    elseif v then
      out[i] = -1
    else
      out[i] = 0
    end
  end
  if freed and ARGV[1] ~= '0' then
    local r = redis.pcall('PUBLISH', 'quorumlock:free:' .. key, ARGV[1])
    if type(r) == 'number' then out[i] = out[i] + r end
  end
end
return out"
);

/// Compare-and-pexpire to `ARGV[1]` milliseconds; `ARGV[2]` is the longest
/// TTL the client knew of before (and the histories it knows, as for
/// [`ACQUIRE`]), and the tokens follow (`ARGV[i + 2]`). Its last
/// key is [`META_KEY`], where the TTL is recorded as an acquire records
/// it, so that the delayed-restart rule also knows TTLs that grew by
/// extension.
pub(crate) static EXTEND: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(EXTEND_LUA));

/// Source of [`EXTEND`]. A reader's entry is extended while it lives
/// (its score is the node's time in ms: an expired one is absent).
pub(crate) const EXTEND_LUA: &str = concat!(
    r"local out = {}
local meta = KEYS[#KEYS]
local known = tonumber(redis.call('HGET', meta, 'max_ttl')) or 0
",
    raise_lua!(),
    readers_lua!(),
    r"for i = 1, #KEYS - 1 do
  local key, tok = KEYS[i], ARGV[i + 2]
  if string.byte(tok, 1) == 114 then
    ",
    make_readers_lua!(),
    r"    local set = own_set(key)
    local s = set == true and redis.call('ZSCORE', key, tok)
    if set == 0 then
      out[i] = -1
    elseif s and tonumber(s) > ms_now() then
      enter(key, tok, ttl)
      out[i] = 1
    else
      out[i] = 0
    end
  else
    ",
    writer_view_lua!("v", "key"),
    r"    if v == tok then
      if redis.call('PTTL', key) < ttl then
        redis.call('PEXPIRE', key, ARGV[1])
      end
      out[i] = 1
    elseif v then
      out[i] = -1
    else
      out[i] = 0
    end
  end
end
return out"
);

/// Sets a held lock's key again where it is missing (its node restarted
/// empty or evicted it, or the acquisition never reached it): `SET NX PX`
/// with our token for `ARGV[1]` ms, so that a held lock lives on every node
/// it can. Sent only after an extension confirmed the lock on a majority
/// (a restored copy is not a vote: the key was not ours when it ran).
/// `KEYS[i]` with token `ARGV[i + 1]`; answers `2` (restored), `1` (ours
/// already) or `-1` (another owner: never overwritten).
pub(crate) static RESTORE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(RESTORE_LUA));

/// Source of [`RESTORE`]. A reader's entry is entered again where it is
/// missing or expired, never where a writer holds the key.
pub(crate) const RESTORE_LUA: &str = concat!(
    readers_lua!(),
    r"local out = {}
for i, key in ipairs(KEYS) do
  local tok = ARGV[i + 1]
  if string.byte(tok, 1) == 114 then
    ",
    make_readers_lua!(),
    r"    local set = own_set(key)
    local s = set == true and redis.call('ZSCORE', key, tok)
    if set == 0 then
      out[i] = -1
    elseif s and tonumber(s) > ms_now() then
      out[i] = 1
    else
      enter(key, tok, tonumber(ARGV[1]))
      out[i] = 2
    end
  elseif redis.call('SET', key, tok, 'NX', 'PX', ARGV[1]) then
    out[i] = 2
  elseif redis.pcall('GET', key) == tok then
    out[i] = 1
  else
    out[i] = -1
  end
end
return out"
);

/// `SCRIPT LOAD` for every script, packed.
pub(crate) fn load_commands() -> [Vec<u8>; 6] {
    [
        ACQUIRE_LUA,
        RELEASE_LUA,
        EXTEND_LUA,
        SWAP_LUA,
        FENCE_LUA,
        RESTORE_LUA,
    ]
    .map(|code| {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(code)
            .get_packed_command()
    })
}
