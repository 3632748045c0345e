"""What the limits keep in Redis, and the three Lua scripts that change it, each atomically.

Keys, per level (a tenant, or one of its keys), all under the tenant's hash tag ``{tenant:<uuid>}``:

- ``requests``: sorted set, one member per admitted request (its lease id), scored by the time it was let in;
- ``tokens`` / ``token_amounts`` / ``token_total``: the same for tokens, with each request's charge in a
  hash and their sum kept beside it (recomputed from the hash if it ever goes missing);
- ``leases``: sorted set of running requests' lease ids, scored by when the lease expires;
- ``budget:<YYYY-MM>``: hash, ``used`` = tokens recorded in ``usage_events`` when the month was first
  needed + settled since + reserved by running requests, and one field per running request's reservation
  (so a settle corrects ``used`` once, and only for a reservation that was made).

A key's level lives under its tenant's tag (``lpx:{tenant:T}:key:K:...``), so one script sees both levels
of a request in one slot and charges them together, in Redis Cluster too. Nothing is lost by it: every
request of a tenant touches the tenant's keys anyway, so a tenant's load was on one shard already.

The scripts keep the in-process limiter's semantics (window.py, memory_store.py) to the same floating
point operations: a charge counts while ``at + window > now``; the wait is the time until enough of the
oldest charges drop off. Times are Redis's own clock (``TIME``), so the replicas' clocks do not matter;
tests pass a time of their own instead (the first argument; empty for the server's clock). Lua numbers
given to ``redis.call`` become strings with 14 digits, too few for a time in seconds since 1970 to the
microsecond, so times are formatted with 17 (``f``) and counts as integers (``d``). The admission and
the settle answer one string of space-separated fields (``-`` for "no time"): parsing nested arrays cost
the gateway more CPU per admission and settle (docs/benchmarks.md#gateway-constants-and-choices). Window keys
expire a little after the window (an idle tenant leaves nothing behind); a month's counter a week after
its month.
"""

from __future__ import annotations

from datetime import datetime

from app.limits.store import Ask

KEYS_PER_LEVEL = 6  # the order below is the order the scripts read KEYS in
LEASES_INDEX = 4


def level_keys(ask: Ask, month_start: datetime) -> tuple[str, ...]:
    """The keys of ``ask``'s level, the budget's for the month that starts at ``month_start``."""
    prefix = f"lpx:{{tenant:{ask.tenant_id}}}" + ("" if ask.key_id is None else f":key:{ask.key_id}")
    return (
        f"{prefix}:requests",
        f"{prefix}:tokens",
        f"{prefix}:token_amounts",
        f"{prefix}:token_total",
        f"{prefix}:leases",
        f"{prefix}:budget:{month_start:%Y-%m}",
    )


_COMMON = """
local WINDOW_S = tonumber(ARGV[2])
local function f(x) return string.format('%.17g', x) end
local function d(x) return string.format('%d', x) end
local function clock()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function level_keys(level)
  local k = level * 6
  return KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5], KEYS[k + 6]
end
-- Drops the charges made a window or more before now; the requests window has no amounts (each is 1).
local function prune(zset, amounts, total, now)
  while true do
    local oldest = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
    if #oldest == 0 or tonumber(oldest[2]) + WINDOW_S > now then return end
    redis.call('ZREM', zset, oldest[1])
    if amounts then
      local amount = redis.call('HGET', amounts, oldest[1])
      redis.call('HDEL', amounts, oldest[1])
      if amount then redis.call('DECRBY', total, amount) end
    end
  end
end
local function token_total(zset, amounts, total)
  if redis.call('EXISTS', zset) == 0 then
    redis.call('DEL', amounts, total)
    return 0
  end
  local value = redis.call('GET', total)
  if value then return tonumber(value) end
  local sum = 0
  for _, amount in ipairs(redis.call('HVALS', amounts)) do sum = sum + tonumber(amount) end
  redis.call('SET', total, d(sum), 'EX', math.ceil(WINDOW_S) + 1)
  return sum
end
local function newest(zset)
  local last = redis.call('ZRANGE', zset, -1, -1, 'WITHSCORES')
  if #last == 0 then return '-' end
  return last[2]
end
"""

ADMIT = (
    _COMMON
    + """
-- ARGV: now, window, lease id, tokens, lease ttl; then per level: rpm, tpm, concurrency, budget (-1: none),
-- the month's recorded usage ('' when not read) and its counter's ttl.
local function wait(zset, amounts, total, amount, limit, now)
  local excess = total + amount - limit
  if excess <= 0 then return 0 end
  local charges = redis.call('ZRANGE', zset, 0, -1, 'WITHSCORES')
  for i = 1, #charges, 2 do
    local charged = 1
    if amounts then charged = tonumber(redis.call('HGET', amounts, charges[i]) or '0') end
    excess = excess - charged
    if excess <= 0 then return tonumber(charges[i + 1]) + WINDOW_S - now end
  end
  return math.huge
end
local now = clock()
local id, num_tokens, lease_ttl = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local num_levels = #KEYS / 6
local seen, missing, room = {}, {}, true
for level = 0, num_levels - 1 do
  local requests, tokens, amounts, total, leases, month = level_keys(level)
  local a = 5 + level * 6
  local rpm, tpm, concurrent, budget = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4])
  prune(requests, nil, nil, now)
  prune(tokens, amounts, total, now)
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', f(now))
  local num_requests = redis.call('ZCARD', requests)
  local num_in_window = token_total(tokens, amounts, total)
  local used = -1
  if budget >= 0 then
    if redis.call('EXISTS', month) == 0 then
      if ARGV[a + 5] == '' then
        missing[#missing + 1] = level
      else
        redis.call('HSET', month, 'used', ARGV[a + 5])
        redis.call('EXPIRE', month, ARGV[a + 6])
      end
    end
    used = tonumber(redis.call('HGET', month, 'used') or '0')
  else
    redis.call('DEL', month)  -- not counted while unlimited: a budget set later reads usage_events again
  end
  local requests_wait, tokens_wait = 0, 0
  if rpm >= 0 then requests_wait = wait(requests, nil, num_requests, 1, rpm, now) end
  if tpm >= 0 then tokens_wait = wait(tokens, amounts, num_in_window, num_tokens, tpm, now) end
  local running = redis.call('ZCARD', leases)
  if (budget >= 0 and used + num_tokens > budget) or (concurrent >= 0 and running >= concurrent)
    or requests_wait > 0 or tokens_wait > 0 then
    room = false
  end
  seen[#seen + 1] = table.concat({d(num_requests), f(requests_wait), d(num_in_window), f(tokens_wait), d(running),
    d(used), newest(requests), newest(tokens)}, ' ')
end
if #missing > 0 then return 'missing ' .. table.concat(missing, ' ') end
if room then
  local idle_s = math.ceil(WINDOW_S) + 1
  for level = 0, num_levels - 1 do
    local requests, tokens, amounts, total, leases, month = level_keys(level)
    redis.call('ZADD', requests, f(now), id)
    redis.call('ZADD', tokens, f(now), id)
    redis.call('HSET', amounts, id, ARGV[4])
    redis.call('INCRBY', total, ARGV[4])
    for _, key in ipairs({requests, tokens, amounts, total}) do redis.call('EXPIRE', key, idle_s) end
    redis.call('ZADD', leases, f(now + lease_ttl), id)
    redis.call('EXPIRE', leases, math.ceil(lease_ttl) + 1)
    if tonumber(ARGV[5 + level * 6 + 4]) >= 0 then
      redis.call('HSET', month, id, ARGV[4])
      redis.call('HINCRBY', month, 'used', ARGV[4])
    end
  end
end
return (room and '1 ' or '0 ') .. f(now) .. ' ' .. table.concat(seen, ' ')
"""
)

SETTLE = (
    _COMMON
    + """
-- ARGV: now, window, lease id, tokens used, undo ('1': take the admission back whole, as if never made).
local now = clock()
local id, used, undo = ARGV[3], tonumber(ARGV[4]), ARGV[5] == '1'
local views = {}
for level = 0, #KEYS / 6 - 1 do
  local requests, tokens, amounts, total, leases, month = level_keys(level)
  prune(requests, nil, nil, now)
  prune(tokens, amounts, total, now)
  redis.call('ZREM', leases, id)
  local charged = redis.call('HGET', amounts, id)
  if charged and undo then
    redis.call('ZREM', tokens, id)
    redis.call('HDEL', amounts, id)
    redis.call('DECRBY', total, charged)
  elseif charged and used < tonumber(charged) then
    redis.call('HSET', amounts, id, ARGV[4])
    redis.call('DECRBY', total, d(tonumber(charged) - used))
  end
  if undo then redis.call('ZREM', requests, id) end
  local reserved = redis.call('HGET', month, id)
  if reserved then
    redis.call('HDEL', month, id)
    local settled = used
    if undo then settled = 0 end
    redis.call('HINCRBY', month, 'used', d(settled - tonumber(reserved)))
  end
  views[#views + 1] = table.concat({d(redis.call('ZCARD', requests)), newest(requests),
    d(token_total(tokens, amounts, total)), newest(tokens)}, ' ')
end
return f(now) .. ' ' .. table.concat(views, ' ')
"""
)

RENEW = (
    _COMMON
    + """
-- ARGV: now, window, lease ttl, then the lease id of each key: its expiry moves to now + ttl, if it is there.
local now = clock()
local ttl = tonumber(ARGV[3])
for i, leases in ipairs(KEYS) do
  redis.call('ZADD', leases, 'XX', f(now + ttl), ARGV[3 + i])
  redis.call('EXPIRE', leases, math.ceil(ttl) + 1)
end
return #KEYS
"""
)
