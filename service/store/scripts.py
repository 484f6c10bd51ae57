"""The job state machine, as Redis Lua scripts: each transition checks and writes the job record, its queue entry
and its event stream in one atomic step. Every Lua script aotc runs is in this module.

            submit           start (attempt += 1)           finish
    (new) ---------> queued ----------------------> running ---------> succeeded | failed | cancelled
                       ^  |                           |
                       |  '--- cancel (at once) ------|--------------> cancelled
                       '------------------------------'
                  requeue: a retryable failure, a lost worker (the reaper), or a hand-back on shutdown or by
                  a broken worker (which refunds the attempt)

A retryable failure's requeue may hold the job back (a delay, its backoff): it stays `queued` but in no stream,
in the `backoff` zset scored by when it may run, until PROMOTE (run by every worker before it reads the queue) adds
its entry to its stream. Both steps are one script each, so at every moment the job is in its stream, held by a
lease, or in `backoff`; the times are Redis's own (TIME), so workers' clocks do not matter.

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
# A live job flagged for cancellation (every namespace on it cancelled it; it ends within seconds) is not joined:
# the request gets a job of its own, and the cache key's inflight entry moves to it (FINISH of the old job deletes
# the entry only while it still names that job).
SUBMIT = """
local existing = redis.call('GET', KEYS[1])
if existing and redis.call('HGET', ARGV[3] .. existing, 'cancel') == '1' then existing = false end
if existing then
  local job = ARGV[3] .. existing
  local st = redis.call('HGET', job, 'state')
  if st == 'queued' and ARGV[5] == 'interactive' and redis.call('HGET', job, 'priority') == 'batch' then
    -- An interactive request joins a batch job still in line: the job moves to the interactive queue. Its batch
    -- entry stays (it may already be in a worker's hands); whichever entry is started first runs the job, and
    -- START drops the other as a duplicate. A job waiting out a retry's backoff has no entry: PROMOTE puts it in
    -- the interactive queue when it is due.
    if redis.call('HEXISTS', job, 'not_before') == 1 then
      redis.call('HSET', job, 'priority', 'interactive')
    else
      local id = redis.call('XADD', KEYS[4], '*', 'job', existing)
      redis.call('HSET', job, 'priority', 'interactive', 'msg', id)
    end
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
# or 'missing' / a terminal state / 'duplicate' / 'backoff' (entry dropped: nothing to do).
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
if redis.call('HEXISTS', KEYS[1], 'not_before') == 1 then
  drop(KEYS[3], ARGV[1], ARGV[2])  -- an older entry of a job that waits out its backoff: PROMOTE queues it again
  return {'backoff', 0}
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

# KEYS: job, events, stream, backoff. ARGV: group, msg id, holder, expected state or '', refund '1'|'0', ts, job id,
#       JSON [field, value, ...], JSON [event field, value, ...], delay in seconds ('0': none).
# Puts the job back in line (a new entry at the tail of its stream) and drops the held entry; with a delay, the
# job waits in `backoff` instead (its record and its queued event say `not_before`), and PROMOTE queues it then.
# Returns 1 done, 0 the job had already ended, -1 not in the expected state, -2 the lease is no longer held.
REQUEUE = _PRELUDE + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st or terminal(st) then drop(KEYS[3], ARGV[1], ARGV[2]); return 0 end
if ARGV[4] ~= '' and st ~= ARGV[4] then return -1 end
if not owns(KEYS[3], ARGV[1], ARGV[2], ARGV[3]) then return -2 end
if st == 'queued' and redis.call('HEXISTS', KEYS[1], 'not_before') == 1 then
  drop(KEYS[3], ARGV[1], ARGV[2])  -- an older entry of a job that waits out its backoff: it keeps waiting
  return 1
end
if ARGV[5] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', -1) end
local delay = tonumber(ARGV[10]) or 0
local ev = {'state', 'queued', 'stage', 'queued', 'ts', ARGV[6]}
redis.call('HDEL', KEYS[1], 'worker', 'not_before')
if delay > 0 then
  local now = redis.call('TIME')
  local due = string.format('%.3f', tonumber(now[1]) + tonumber(now[2]) / 1000000 + delay)
  redis.call('ZADD', KEYS[4], due, ARGV[7])
  redis.call('HDEL', KEYS[1], 'msg')
  redis.call('HSET', KEYS[1], 'state', 'queued', 'stage', 'queued', 'not_before', due, unpack(cjson.decode(ARGV[8])))
  table.insert(ev, 'not_before')
  table.insert(ev, due)
else
  local id = redis.call('XADD', KEYS[3], '*', 'job', ARGV[7])
  redis.call('HSET', KEYS[1], 'state', 'queued', 'stage', 'queued', 'msg', id, unpack(cjson.decode(ARGV[8])))
end
drop(KEYS[3], ARGV[1], ARGV[2])
for _, v in ipairs(cjson.decode(ARGV[9])) do table.insert(ev, v) end
event(KEYS[2], ev)
return 1
"""

# KEYS: backoff. ARGV: job key prefix, queue key prefix, most jobs to move.
# Queues the jobs whose backoff is over: each one still queued gets an entry at the tail of its stream (by its
# record's target and priority, as SUBMIT would make it); one that ended meanwhile (cancelled) just leaves `backoff`.
# Returns how many were queued.
PROMOTE = """
local now = redis.call('TIME')
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', tonumber(now[1]) + tonumber(now[2]) / 1000000,
                       'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, id in ipairs(due) do
  local job = ARGV[1] .. id
  local rec = redis.call('HMGET', job, 'state', 'target', 'priority', 'not_before')
  if rec[1] == 'queued' and rec[4] and rec[2] and rec[3] then
    local msg = redis.call('XADD', ARGV[2] .. rec[2] .. ':' .. rec[3], '*', 'job', id)
    redis.call('HSET', job, 'msg', msg)
    redis.call('HDEL', job, 'not_before')
    n = n + 1
  end
  redis.call('ZREM', KEYS[1], id)
end
return n
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

# -- reads and counters outside the state machine ----------------------------------------------------------------

# Appends (key, record) to `out` for each artifact of model `id` that still has a record (ARGV[4]: the by-model set
# prefix, ARGV[5]: the artifact record prefix): FIND_MODEL's and RESOLVE_FIND's end.
_APPEND_ARTIFACTS = """
for _, k in ipairs(redis.call('SMEMBERS', ARGV[4] .. id)) do
  local record = redis.call('GET', ARGV[5] .. k)
  if record then
    out[#out + 1] = k
    out[#out + 1] = record
  end
end
"""

# KEYS: none: they depend on the id the script resolves (one Redis, as SUBMIT builds a job's key).
# ARGV: model id or a prefix of it (hex), the `models:ids` key, and the key prefixes of a model record, of a
#       model's artifact set and of an artifact record; the model id the caller already holds ('' if none), and
#       '1' to return the model's artifacts too.
# Resolves a short id by lex range (never a scan) and reads the model and its artifacts in one round trip.
# Returns one string, its fields joined by NUL (JSON never holds a raw NUL; one bulk reply parses far faster in
# redis-py than an array): 'none' | 'ambiguous' | 'ok', id, model record ('' when it is the caller's id and still
# exists), then artifact key, its record, ... for the artifacts that still have a record.
FIND_MODEL = """
local id = ARGV[1]
if #id ~= 64 then
  local found = redis.call('ZRANGEBYLEX', ARGV[2], '[' .. id, '[' .. id .. '\\255', 'LIMIT', 0, 2)
  if #found == 0 then return 'none' end
  if #found > 1 then return 'ambiguous' end
  id = found[1]
end
local model
if id == ARGV[6] then
  if redis.call('EXISTS', ARGV[3] .. id) == 0 then return 'none' end
  model = ''
else
  model = redis.call('GET', ARGV[3] .. id)
  if not model then return 'none' end
end
local out = {'ok', id, model}
if ARGV[7] == '1' then
""" + _APPEND_ARTIFACTS + """end
return table.concat(out, '\\0')
"""

# KEYS: the observed-jobs set, then one histogram hash per timing. ARGV: job id, then a bucket field and the
# seconds for each histogram, in KEYS' order. Counts one job's timings in the /metrics histograms exactly once,
# however many API processes see the job end.
OBSERVE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 2, #KEYS do
  redis.call('HINCRBY', KEYS[i], ARGV[2 * i - 2], 1)
  redis.call('HINCRBY', KEYS[i], 'count', 1)
  redis.call('HINCRBYFLOAT', KEYS[i], 'sum', ARGV[2 * i - 1])
end
return 1
"""

# -- blobs and the bounded artifact cache --------------------------------------------------------------------------
# Artifacts are a cache that aotc evicts itself (Redis runs with maxmemory-policy noeviction): least recently pulled
# first, never a pinned one. An artifact's record, its index entries and its accounting change in one script, so a
# lookup never returns what cannot be pulled; its bytes go after, through blobs:garbage.

# KEYS: manifest. ARGV: prefix of the new chunks' keys, chunk count, size, sha256, chunk bytes, generation, prefix of
# the chunks of a manifest without a generation.
# Makes a redis-store blob visible: its chunks (written with an expiry, so a writer killed midway leaves nothing
# behind for long) lose their expiry, then the manifest names them; the chunks of the write it replaces are deleted.
# Returns 1, or an error when a chunk is missing (it expired before the write finished).
BLOB_COMMIT = """
local n = tonumber(ARGV[2])
for i = 0, n - 1 do
  if redis.call('EXISTS', ARGV[1] .. i) == 0 then return redis.error_reply('blob chunk ' .. i .. ' is missing') end
end
local old = redis.call('HMGET', KEYS[1], 'chunks', 'gen')
for i = 0, n - 1 do redis.call('PERSIST', ARGV[1] .. i) end
redis.call('HSET', KEYS[1], 'size', ARGV[3], 'chunks', ARGV[2], 'sha256', ARGV[4], 'chunk_bytes', ARGV[5],
           'gen', ARGV[6])
if old[1] and old[2] ~= ARGV[6] then
  local prefix = ARGV[7]
  if old[2] then prefix = ARGV[7] .. old[2] .. ':' end
  for i = 0, tonumber(old[1]) - 1 do redis.call('DEL', prefix .. i) end
end
return 1
"""

# KEYS: manifest. ARGV: prefix of the chunks of a manifest without a generation.
# Deletes a redis-store blob: the manifest and every chunk it names, in one step. Returns 1, or 0 if absent.
BLOB_DELETE = """
local m = redis.call('HMGET', KEYS[1], 'chunks', 'gen')
if not m[1] then return 0 end
redis.call('DEL', KEYS[1])
local prefix = ARGV[1]
if m[2] then prefix = ARGV[1] .. m[2] .. ':' end
for i = 0, tonumber(m[1]) - 1 do redis.call('DEL', prefix .. i) end
return 1
"""

# KEYS: record, index, by-model set, pulled, bytes, total, garbage, weights bytes, weights users of its digest.
# ARGV: record JSON, created, key, bytes held in the blob store, blob id, weights sha256 ('' for none), its bytes.
# Publishes an artifact whose blobs are stored: the record, its index entries and its accounting at once. Returns 1,
# or 0 when the key was already published (the caller's blobs are then surplus). A weights blob's users gain the key;
# its bytes count once in the total, from its first user on; a pending deletion of it is called off.
PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[5], ARGV[3], ARGV[4])
redis.call('INCRBY', KEYS[6], ARGV[4])
redis.call('ZREM', KEYS[7], ARGV[5])
if ARGV[6] ~= '' then
  redis.call('SADD', KEYS[9], ARGV[3])
  if redis.call('HSETNX', KEYS[8], ARGV[6], ARGV[7]) == 1 then redis.call('INCRBY', KEYS[6], ARGV[7]) end
  redis.call('ZREM', KEYS[7], 'weights:' .. ARGV[6])
end
return 1
"""

# KEYS: record, pulled, bytes, total. ARGV: key, created, bytes.
# Counts an artifact published before the cache was bounded (no accounting yet). Returns 1 counted, 0 nothing to do.
ADOPT = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('INCRBY', KEYS[4], ARGV[3])
redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[1])
return 1
"""

# KEYS: pulled, bytes, total, pinned, index, garbage.
# ARGV: the bound in bytes, bytes about to be added, a key never to evict ('' for none), the key prefix ('aotc:'),
# when a weights blob that loses its last user is deleted (a grace, so a publish that found it a moment ago keeps it).
# An evicted artifact leaves its weights blob's users; the last one out takes its bytes off the total.
# Evicts the least recently pulled artifacts that are not pinned, nor of a model a registry version holds, until
# total + incoming fits the bound: each one's record, report, index entries and accounting go at once, and its blob
# id goes to blobs:garbage (score 0: delete now). The first write is a DEL, which Redis allows even when it is out of
# memory. Returns the evicted keys.
EVICT = """
local bound, incoming, spare, p = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local evicted, skipped = {}, 0
while total + incoming > bound do
  local batch = redis.call('ZRANGE', KEYS[1], skipped, skipped + 63)
  if #batch == 0 then break end
  for _, key in ipairs(batch) do
    if total + incoming <= bound then break end
    local held = key == spare or redis.call('SISMEMBER', KEYS[4], key) == 1
    local raw = nil
    if not held then
      -- A model some registry version holds (pins:model:{model}, service/store/names.py) keeps its artifacts.
      raw = redis.call('GET', p .. 'artifact:' .. key)
      if raw then
        local rec = cjson.decode(raw)
        if type(rec.factors) == 'table' and type(rec.factors.model) == 'string'
            and redis.call('EXISTS', p .. 'pins:model:' .. rec.factors.model) == 1 then
          held = true
        end
      end
    end
    if held then
      skipped = skipped + 1
    else
      redis.call('DEL', p .. 'artifact:' .. key, p .. 'report:' .. key)
      redis.call('ZREM', KEYS[5], key)
      redis.call('ZREM', KEYS[1], key)
      local blob = key
      if raw then
        local rec = cjson.decode(raw)
        if type(rec.blob) == 'string' then blob = rec.blob end
        if type(rec.factors) == 'table' and type(rec.factors.model) == 'string' then
          redis.call('SREM', p .. 'artifacts:by-model:' .. rec.factors.model, key)
        end
        if type(rec.weights) == 'table' and type(rec.weights.sha256) == 'string' then
          local d = rec.weights.sha256
          local users = p .. 'weights:users:' .. d
          redis.call('SREM', users, key)
          if redis.call('SCARD', users) == 0 then
            local wb = tonumber(redis.call('HGET', p .. 'weights:bytes', d) or '0')
            redis.call('HDEL', p .. 'weights:bytes', d)
            total = redis.call('DECRBY', KEYS[3], wb)
            redis.call('ZADD', KEYS[6], ARGV[5], 'weights:' .. d)
          end
        end
      end
      local bytes = tonumber(redis.call('HGET', KEYS[2], key) or '0')
      redis.call('HDEL', KEYS[2], key)
      total = redis.call('DECRBY', KEYS[3], bytes)
      redis.call('ZADD', KEYS[6], 0, blob)
      evicted[#evicted + 1] = key
    end
  end
end
return evicted
"""

# KEYS: record, pinned. ARGV: key. Pins an artifact that exists (1), else 0: a pin never outlives its record.
PIN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# -- admission: what one API key holds open, and the job quota ----------------------------------------------------
# Counted in Redis, so every API process sees the same numbers, and held as leases that lapse on Redis's clock
# (TIME): what an API process that died held comes back by itself, and API hosts' clocks do not matter.

# KEYS: the key's slots zset (token -> lapse time, ms). ARGV: the cap, lease ms, token.
# Takes a slot if fewer than the cap are held (lapsed ones are dropped first). Returns the slots held with this one,
# or minus the number held when the cap is reached.
SLOT_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[1]) then return -n end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return n + 1
"""

# KEYS: slots zsets, one per lease. ARGV: lease ms, then each lease's token in KEYS' order.
# Extends every lease this API process still holds open. One that lapsed meanwhile (Redis was unreachable for longer
# than a lease) is taken again: its stream or upload is still open, so it still counts. Returns how many.
SLOT_RENEW = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], until_ms, ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
end
return #KEYS
"""

# KEYS: the namespace's active set, its reserved zset. ARGV: job key prefix, jobs wanted, max_jobs, lease ms, token.
# Admits a compile request against the namespace's job quota in one step: its queued and running jobs (ended ones
# leave the active set here) plus the reservations other requests hold, plus `wanted`, must fit max_jobs. Admitted,
# it reserves `wanted` slots (token:1..token:wanted), which Namespaces.add_job fills as it records each job, in the
# same transaction. Returns {1 admitted | 0 refused, active jobs, reserved by others}.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local active = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local st = redis.call('HGET', ARGV[1] .. id, 'state')
  if st == 'queued' or st == 'running' then active = active + 1 else redis.call('SREM', KEYS[1], id) end
end
local reserved = redis.call('ZCARD', KEYS[2])
local wanted = tonumber(ARGV[2])
if active + reserved + wanted > tonumber(ARGV[3]) then return {0, active, reserved} end
for i = 1, wanted do redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[5] .. ':' .. i) end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, active, reserved}
"""


# KEYS: the namespace's jobs (zset by when it asked), the global job index, the dead letters, the metrics' observed
#       jobs. ARGV: the namespace, how many of its jobs to keep, the most to drop in one call, the most to look at
#       (from the oldest), and the key prefix of a job record (its events and namespaces are `<prefix><id>:events`,
#       `<prefix><id>:namespaces`).
# Drops the namespace's oldest jobs past the number it keeps, ended ones only (a queued or running job is skipped,
# never dropped, and its place goes to the next): the namespace lets go of each; a job no namespace holds any more
# goes with its record, its event stream and its index entries. Returns how many the namespace let go of.
TRIM_JOBS = """
local over = math.min(redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[2]), tonumber(ARGV[3]))
if over <= 0 then return 0 end
local dropped = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[4]) - 1)) do
  if dropped >= over then break end
  local job = ARGV[5] .. id
  local st = redis.call('HGET', job, 'state')
  if st ~= 'queued' and st ~= 'running' then
    redis.call('ZREM', KEYS[1], id)
    redis.call('SREM', job .. ':namespaces', ARGV[1])
    dropped = dropped + 1
    if redis.call('SCARD', job .. ':namespaces') == 0 then
      redis.call('DEL', job, job .. ':events', job .. ':namespaces')
      redis.call('ZREM', KEYS[2], id)
      redis.call('LREM', KEYS[3], 0, id)
      redis.call('SREM', KEYS[4], id)
    end
  end
end
return dropped
"""


# -- the registry: names, versions and tags (service/store/names.py) ---------------------------------------------
# A name's versions, tags and tag history change together in one script each, so a reader never sees a tag on a
# version that is gone, and two tag moves racing are ordered, each recorded with who made it and when.

_REGISTRY_PRELUDE = """
-- The namespace's tag history, bounded over all its names: H.count (a key) holds how many moves every name's
-- history keeps, made once where it is missing from the live names (H.names) and the gone ones (H.gone, a zset of
-- names whose last version was deleted -> when, oldest forgotten first). setup_history must run before any change.
-- A namespace's count (a key), made once where it is missing from what it holds: `len_cmd` of `prefix .. name ..
-- suffix` summed over the names of the zsets `sets`. A namespace from before a count starts at what it holds.
local function made_count(count, sets, prefix, suffix, len_cmd)
  local n = redis.call('GET', count)
  if n then return tonumber(n) end
  local total = 0
  for _, set in ipairs(sets) do
    for _, name in ipairs(redis.call('ZRANGE', set, 0, -1)) do
      total = total + redis.call(len_cmd, prefix .. name .. suffix)
    end
  end
  redis.call('SET', count, total)
  return total
end

local H = {}
local function setup_history(count, names, gone, prefix, budget, max_gone)
  H.count, H.names, H.gone, H.prefix = count, names, gone, prefix
  H.budget, H.max_gone = tonumber(budget), tonumber(max_gone)
  made_count(count, {names, gone}, prefix, ':history', 'LLEN')
end

-- Forget the oldest gone name: its history, its tags (none left) and its last version number, so that a name made
-- again with it starts at 1. Returns false when no name is gone.
local function forget_oldest_gone()
  local top = redis.call('ZPOPMIN', H.gone)
  if #top == 0 then return false end
  local p = H.prefix .. top[1]
  redis.call('DECRBY', H.count, redis.call('LLEN', p .. ':history'))
  redis.call('DEL', p .. ':history', p .. ':seq', p .. ':tags')
  return true
end

-- Over the namespace's budget, the oldest gone names are forgotten first; then the history just added to keeps
-- only its newest HISTORY_FLOOR moves.
local HISTORY_FLOOR = 10
local function hold_budget(hist)
  while tonumber(redis.call('GET', H.count)) > H.budget and forget_oldest_gone() do end
  local n = redis.call('LLEN', hist)
  if tonumber(redis.call('GET', H.count)) > H.budget and n > HISTORY_FLOOR then
    redis.call('LTRIM', hist, 0, HISTORY_FLOOR - 1)
    redis.call('DECRBY', H.count, n - HISTORY_FLOOR)
  end
end

local function record_move(hist, cap, tag, from, to, by, at)
  local e = {tag = tag, by = by, at = tonumber(at)}
  if from then e['from'] = tonumber(from) end
  if to then e['to'] = tonumber(to) end
  local before = redis.call('LLEN', hist)
  redis.call('LPUSH', hist, cjson.encode(e))
  redis.call('LTRIM', hist, 0, tonumber(cap) - 1)
  redis.call('INCRBY', H.count, redis.call('LLEN', hist) - before)
  hold_budget(hist)
end
"""

# Every registry script's last keys and arguments, for the history's bounds (setup_history):
#   KEYS[-3..-1]: the namespace's count of history entries, its names zset, its gone names zset
#   ARGV[-3..-1]: the key prefix of a name's keys ('<prefix>{name}:history'), the history budget over the
#                 namespace (AOTC_MAX_TAG_HISTORY), the most gone names remembered (AOTC_MAX_GONE_NAMES)
_HISTORY_SETUP = """
setup_history(KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS], ARGV[#ARGV - 2], ARGV[#ARGV - 1], ARGV[#ARGV])
"""

# KEYS: the namespace's names zset, seq, versions, tags, history, the model's pins set, the namespace's count of
#       versions, then the history's three (above).
# ARGV: name, version record (JSON), ts, by, holder prefix ('{ns}/{name}@'), max names, max versions, max tags,
#       history cap, JSON list of tags to move to the new version, max versions in the namespace, the key prefix of
#       a name's keys ('<prefix>{name}:versions'), then the history's three.
# Returns {'ok', version} or {refusal, limit}: 'names', 'versions', 'ns_versions' or 'tags' when a limit would be
# passed. A gone name made again is no longer gone.
VERSION_ADD = _REGISTRY_PRELUDE + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[6]) then
  return {'names', ARGV[6]}
end
if redis.call('HLEN', KEYS[3]) >= tonumber(ARGV[7]) then return {'versions', ARGV[7]} end
if made_count(KEYS[7], {KEYS[1]}, ARGV[12], ':versions', 'HLEN') >= tonumber(ARGV[11]) then
  return {'ns_versions', ARGV[11]}
end
local tags = cjson.decode(ARGV[10])
local new = 0
for _, t in ipairs(tags) do
  if redis.call('HEXISTS', KEYS[4], t) == 0 then new = new + 1 end
end
if redis.call('HLEN', KEYS[4]) + new > tonumber(ARGV[8]) then return {'tags', ARGV[8]} end
""" + _HISTORY_SETUP + """
local v = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[3], v, ARGV[2])
redis.call('INCR', KEYS[7])
redis.call('ZADD', KEYS[1], 'NX', ARGV[3], ARGV[1])
redis.call('ZREM', H.gone, ARGV[1])
redis.call('SADD', KEYS[6], ARGV[5] .. v)
for _, t in ipairs(tags) do
  local old = redis.call('HGET', KEYS[4], t)
  redis.call('HSET', KEYS[4], t, v)
  record_move(KEYS[5], ARGV[9], t, old, v, ARGV[4], ARGV[3])
end
return {'ok', v}
"""

# KEYS: versions, tags, history, then the history's three. ARGV: tag, version, by, ts, max tags, history cap, then
# the history's three.
# Moves (or sets) a tag. Returns {'ok', previous version or ''}, {'same', version}, {'version', ''} when there is
# no such version, or {'tags', limit}.
TAG_MOVE = _REGISTRY_PRELUDE + """
if redis.call('HEXISTS', KEYS[1], ARGV[2]) == 0 then return {'version', ''} end
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old == ARGV[2] then return {'same', old} end
if not old and redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[5]) then return {'tags', ARGV[5]} end
""" + _HISTORY_SETUP + """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
record_move(KEYS[3], ARGV[6], ARGV[1], old, ARGV[2], ARGV[3], ARGV[4])
return {'ok', old or ''}
"""

# KEYS: tags, history, then the history's three. ARGV: tag, by, ts, history cap, then the history's three.
# Returns the version the tag named, or false if none.
UNTAG = _REGISTRY_PRELUDE + """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return false end
""" + _HISTORY_SETUP + """
redis.call('HDEL', KEYS[1], ARGV[1])
record_move(KEYS[2], ARGV[4], ARGV[1], old, nil, ARGV[2], ARGV[3])
return old
"""

# KEYS: names zset, versions, tags, history, the model's pins set, the namespace's count of versions, then the
# history's three.
# ARGV: name, version, holder ('{ns}/{name}@{v}'), by, ts, history cap, then the history's three.
# Deletes a version, the tags on it (each move recorded) and its hold on the model: the model's artifacts stay
# pinned only while another version holds it. A name left with no version is gone: its history and last version
# number are kept until AOTC_MAX_GONE_NAMES newer gone names (or the history's budget) push them out. Returns false
# when there is no such version, else the tags removed.
VERSION_DELETE = _REGISTRY_PRELUDE + """
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then return false end
""" + _HISTORY_SETUP + """
redis.call('HDEL', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[6]) == 1 then redis.call('DECR', KEYS[6]) end  -- else made whole at the next add
redis.call('SREM', KEYS[5], ARGV[3])
local removed = {}
local all = redis.call('HGETALL', KEYS[3])
for i = 1, #all, 2 do
  if all[i + 1] == ARGV[2] then
    redis.call('HDEL', KEYS[3], all[i])
    record_move(KEYS[4], ARGV[6], all[i], ARGV[2], nil, ARGV[4], ARGV[5])
    removed[#removed + 1] = all[i]
  end
end
if redis.call('HLEN', KEYS[2]) == 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZADD', H.gone, ARGV[5], ARGV[1])
  while redis.call('ZCARD', H.gone) > H.max_gone and forget_oldest_gone() do end
end
return removed
"""

# The reference's version and its record, as `v` and `rec` (or false for none): RESOLVE's and RESOLVE_FIND's start.
_RESOLVE_VERSION = """
local v
if ARGV[1] == 'version' then
  v = ARGV[2]
elseif ARGV[1] == 'latest' then
  local top = nil
  for _, k in ipairs(redis.call('HKEYS', KEYS[1])) do
    local n = tonumber(k)
    if n and (not top or n > top) then top = n end
  end
  if not top then return false end
  v = tostring(top)
else
  v = redis.call('HGET', KEYS[2], ARGV[2])
  if not v then return false end
end
local rec = redis.call('HGET', KEYS[1], v)
if not rec then return false end
"""

# KEYS: versions, tags. ARGV: 'tag' | 'version' | 'latest', the tag or version.
# One round trip from a reference to its version: returns {version, record, its tags...} or false.
RESOLVE = _RESOLVE_VERSION + """
local out = {v, rec}
local tags = redis.call('HGETALL', KEYS[2])
for i = 1, #tags, 2 do
  if tags[i + 1] == v then out[#out + 1] = tags[i] end
end
return out
"""

# KEYS: a name's versions hash, its tags hash. ARGV: as RESOLVE's (kind, value), then the model record prefix, the
# by-model artifact set prefix, the artifact record prefix, and a model id whose record the caller holds already
# (its record is then only checked to exist, as FIND_MODEL does). The pick by tag's one round trip (GET
# /v1/refs/{ref}/pick): RESOLVE, then FIND_MODEL's read of the version's model and its artifacts. Returns false for
# no such version; else one string, NUL-separated: version, version record, the number of its tags, the tags, then
# 'none' (the model is gone) or the model id, its record ('' when held), and (key, record) per artifact.
RESOLVE_FIND = _RESOLVE_VERSION + """
local tagged = {}
local tags = redis.call('HGETALL', KEYS[2])
for i = 1, #tags, 2 do
  if tags[i + 1] == v then tagged[#tagged + 1] = tags[i] end
end
local out = {v, rec, tostring(#tagged)}
for _, t in ipairs(tagged) do out[#out + 1] = t end
local ok, decoded = pcall(cjson.decode, rec)
local id = ok and type(decoded) == 'table' and decoded['model_id'] or nil
local model
if type(id) ~= 'string' then
  model = nil
elseif id == ARGV[6] then
  if redis.call('EXISTS', ARGV[3] .. id) == 1 then model = '' end
else
  model = redis.call('GET', ARGV[3] .. id)
end
if not model then
  out[#out + 1] = 'none'
  return table.concat(out, '\\0')
end
out[#out + 1] = id
out[#out + 1] = model
""" + _APPEND_ARTIFACTS + """return table.concat(out, '\\0')
"""
