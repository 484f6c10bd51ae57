"""The job state machine, as Redis Lua scripts: each transition checks and writes the job record, its queue entry
and its event stream in one atomic step. Every Lua script aotc runs is in this module.

            submit           start (attempt += 1)           finish
    (new) ---------> queued ----------------------> running ---------> succeeded | failed | cancelled
                       ^  |                           |
                       |  '--- cancel (at once) ------|--------------> cancelled
                       '------------------------------'
                  requeue: a retryable failure, a lost worker (the reaper), or a hand-back on shutdown
                  (which refunds the attempt)

Submit is single-flight: a request whose cache key already has a queued or running job joins that job (an
interactive request moves a queued batch job to the interactive queue) instead of making a second one.

A worker holds a job through its queue entry: the entry is pending in the consumer group under the worker's
name (a lease that the worker's heartbeat renews). Every transition a lease holder makes checks, inside the
script, that the entry is still pending under its name, so a worker whose lease a reaper took can no longer
change the job. Transitions on a job that already ended do nothing and drop the entry.

Redis 6.2's XAUTOCLAIM cannot name an entry that was deleted while pending, so an entry is deleted only together
with its acknowledgement, or when nobody holds it.
"""

from __future__ import annotations

_PRELUDE = """
local function terminal(st) return st == 'succeeded' or st == 'failed' or st == 'cancelled' end
local function owns(stream, group, id, consumer)
  return #redis.call('XPENDING', stream, group, id, id, 1, consumer) > 0
end
local function drop(stream, group, id)
  redis.call('XACK', stream, group, id)
  redis.call('XDEL', stream, id)
end
local function event(key, fields)
  redis.call('XADD', key, 'MAXLEN', '~', 500, '*', unpack(fields))
end
"""

# KEYS: inflight, job, jobs index, queue stream, events.
# ARGV: job id, ts, job key prefix, JSON [field, value, ...] of the new record, priority.
# Joins the live job for this cache key, or creates, indexes and enqueues a new one. Returns {job id, created 1|0}.
SUBMIT = """
local existing = redis.call('GET', KEYS[1])
if existing then
  local job = ARGV[3] .. existing
  local st = redis.call('HGET', job, 'state')
  if st == 'queued' and ARGV[5] == 'interactive' and redis.call('HGET', job, 'priority') == 'batch' then
    -- An interactive request joins a batch job still in line: the job moves to the interactive queue. Its batch
    -- entry stays (it may already be in a worker's hands); whichever entry is started first runs the job, and
    -- START drops the other as a duplicate.
    local id = redis.call('XADD', KEYS[4], '*', 'job', existing)
    redis.call('HSET', job, 'priority', 'interactive', 'msg', id)
    redis.call('XADD', job .. ':events', 'MAXLEN', '~', 500, '*', 'state', 'queued', 'stage', 'queued',
               'priority', 'interactive', 'ts', ARGV[2])
    return {existing, 0}
  end
  if st == 'queued' or st == 'running' then return {existing, 0} end
end
redis.call('HSET', KEYS[2], unpack(cjson.decode(ARGV[4])))
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], 'msg', redis.call('XADD', KEYS[4], '*', 'job', ARGV[1]))
redis.call('XADD', KEYS[5], 'MAXLEN', '~', 500, '*', 'state', 'queued', 'stage', 'queued', 'ts', ARGV[2])
return {ARGV[1], 1}
"""

# KEYS: job, events, stream. ARGV: group, msg id, worker, ts.
# Returns {outcome, attempt}: 'running' (attempt counted now), 'cancel' (cancelled while queued: finish it),
# or 'missing' / a terminal state / 'duplicate' (entry dropped: nothing to do).
START = _PRELUDE + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then drop(KEYS[3], ARGV[1], ARGV[2]); return {'missing', 0} end
if terminal(st) then drop(KEYS[3], ARGV[1], ARGV[2]); return {st, 0} end
if st == 'running' then
  if redis.call('HGET', KEYS[1], 'worker') == ARGV[3] and redis.call('HGET', KEYS[1], 'msg') == ARGV[2] then
    return {'running', tonumber(redis.call('HGET', KEYS[1], 'attempt'))}  -- a retried call that already ran
  end
  drop(KEYS[3], ARGV[1], ARGV[2])  -- a second entry for a job another worker runs
  return {'duplicate', 0}
end
if redis.call('HGET', KEYS[1], 'cancel') == '1' then return {'cancel', 0} end
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'stage', 'fetch', 'started', ARGV[4], 'worker', ARGV[3],
           'attempt', n, 'msg', ARGV[2])
event(KEYS[2], {'state', 'running', 'stage', 'fetch', 'attempt', n, 'worker', ARGV[3], 'ts', ARGV[4]})
return {'running', n}
"""

# KEYS: job, events, stream, inflight, deadletter.
# ARGV: group, msg id or '', holder or '' (no lease: the entry is deleted unless someone holds it),
#       expected state or '', new state, ts, job id, JSON [field, value, ...], JSON [event field, value, ...].
# Returns 1 done, 0 the job had already ended, -1 not in the expected state, -2 the lease is no longer held.
FINISH = _PRELUDE + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st or terminal(st) then
  if ARGV[2] ~= '' and ARGV[3] ~= '' then drop(KEYS[3], ARGV[1], ARGV[2]) end
  return 0
end
if ARGV[4] ~= '' and st ~= ARGV[4] then return -1 end
if ARGV[2] ~= '' and ARGV[3] ~= '' and not owns(KEYS[3], ARGV[1], ARGV[2], ARGV[3]) then return -2 end
redis.call('HSET', KEYS[1], 'state', ARGV[5], 'stage', ARGV[5], 'finished', ARGV[6], unpack(cjson.decode(ARGV[8])))
if redis.call('GET', KEYS[4]) == ARGV[7] then redis.call('DEL', KEYS[4]) end
if ARGV[5] == 'failed' then
  redis.call('LPUSH', KEYS[5], ARGV[7])
  redis.call('LTRIM', KEYS[5], 0, 9999)
end
if ARGV[2] ~= '' then
  if ARGV[3] ~= '' then drop(KEYS[3], ARGV[1], ARGV[2])
  elseif #redis.call('XPENDING', KEYS[3], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then redis.call('XDEL', KEYS[3], ARGV[2])
  end
end
local ev = {'state', ARGV[5], 'stage', ARGV[5], 'ts', ARGV[6]}
for _, v in ipairs(cjson.decode(ARGV[9])) do table.insert(ev, v) end
event(KEYS[2], ev)
return 1
"""

# KEYS: job, events, stream. ARGV: group, msg id, holder, expected state or '', refund '1'|'0', ts, job id,
#       JSON [field, value, ...], JSON [event field, value, ...].
# Puts the job back in line (a new entry at the tail of its stream) and drops the held entry.
# Returns 1 done, 0 the job had already ended, -1 not in the expected state, -2 the lease is no longer held.
REQUEUE = _PRELUDE + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st or terminal(st) then drop(KEYS[3], ARGV[1], ARGV[2]); return 0 end
if ARGV[4] ~= '' and st ~= ARGV[4] then return -1 end
if not owns(KEYS[3], ARGV[1], ARGV[2], ARGV[3]) then return -2 end
if ARGV[5] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', -1) end
local id = redis.call('XADD', KEYS[3], '*', 'job', ARGV[7])
redis.call('HDEL', KEYS[1], 'worker')
redis.call('HSET', KEYS[1], 'state', 'queued', 'stage', 'queued', 'msg', id, unpack(cjson.decode(ARGV[8])))
drop(KEYS[3], ARGV[1], ARGV[2])
local ev = {'state', 'queued', 'stage', 'queued', 'ts', ARGV[6]}
for _, v in ipairs(cjson.decode(ARGV[9])) do table.insert(ev, v) end
event(KEYS[2], ev)
return 1
"""

# KEYS: stream. ARGV: group, msg id, holder. Renews a lease only while the holder still has it: XCLAIM alone
# would take the entry back from a reaper that has just claimed it.
RENEW = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3]) == 0 then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""

# KEYS: job. Flags a live job for cancellation; returns its state (false when there is no such job).
CANCEL = _PRELUDE + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return false end
if not terminal(st) then redis.call('HSET', KEYS[1], 'cancel', '1') end
return st
"""

# KEYS: job, events. ARGV: worker, stage, ts. A stage change from the worker that runs the job, and only then.
STAGE = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' or redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'stage', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 500, '*', 'state', 'running', 'stage', ARGV[2], 'ts', ARGV[3])
return 1
"""
