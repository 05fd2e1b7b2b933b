"""Every Redis key kvmesh writes, in one place.

    kvmesh:epoch:{kind}:{id}   INCR counter. Each start of a process takes the next value: its epoch,
                               a fencing token. A process whose epoch is no longer the counter's value
                               has been replaced and must stop renewing (and serving). A process whose
                               record expired (paused, starved, cut off from Redis past its lease)
                               takes the next value too when it comes back: readers may have declared
                               it dead, so it rejoins as a new incarnation and drops its old work.
    kvmesh:svc:{kind}:{id}     JSON ServiceRecord (addresses, model info, load), SET ... PX lease_ms,
                               renewed by every heartbeat only while the epoch still matches and the
                               record still exists (Lua). Gone == dead: readers treat a missing record
                               as a failed process.
    kvmesh:svcs:{kind}         SET of ids ever registered of this kind (discovery index; members whose
                               record has expired are pruned by readers).

    kvmesh:redis-incarnation   A random value set (NX) by every registration and renewal: the first
                               writer after Redis lost its data (restart without persistence) sets a
                               new one. Readers that see it change know every record vanished at once,
                               none expired, and give each process a lease to write its record back
                               (registry.Membership) instead of declaring it dead.

    kind: worker | tokenizer | scheduler | gateway | prefix-cache

The prefix-cache service's block-ownership keys (block -> owners, worker -> blocks) are described
with their protocol in docs/kv_events.md; they are purged when a worker's record expires.
A worker record's info carries `role` and `kv_layout` (the scheduler pairs prefill and decode
workers whose layouts are equal, the weights' digest included); a decode worker's addrs carry `kv`
(its KV-transfer socket).

No key per prefill/decode hand-off: its lease (--handoff-lease-ms) lives in the prefill worker,
the only process that can free the blocks it holds, and renews with every frame the decode worker
takes; the failures that cross processes are seen through the worker records above (a decode
worker's record gone: the scheduler aborts the request on its prefill worker; a prefill worker's
gone: the scheduler re-runs it on its decode worker). docs/architecture.md, "KV transfer".
Reserved for later: kvmesh:tenant:{tenant}:tokens (token buckets).
"""
from __future__ import annotations

PREFIX = "kvmesh"
KINDS = ("worker", "tokenizer", "scheduler", "gateway", "prefix-cache")


def epoch_key(kind: str, id_: str) -> str:
    return f"{PREFIX}:epoch:{kind}:{id_}"


def record_key(kind: str, id_: str) -> str:
    return f"{PREFIX}:svc:{kind}:{id_}"


def index_key(kind: str) -> str:
    return f"{PREFIX}:svcs:{kind}"


INCARNATION_KEY = f"{PREFIX}:redis-incarnation"


# Script results (bulk strings).
RENEWED, LAPSED, FENCED = b"renewed", b"lapsed", b"fenced"

# KEYS: record, epoch counter, index, incarnation. ARGV: epoch, value, lease ms, id, writer's token.
# Registration, right after INCR took the epoch: writes the record unless a newer start already
# took the counter past it.
CLAIM_LUA = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 'fenced' end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('SET', KEYS[4], ARGV[5], 'NX')
return 'renewed'
"""

# KEYS: record, epoch counter, index, incarnation. ARGV: epoch, value, lease ms, id, writer's token.
# A heartbeat. Renews only while this process's epoch is still the newest one ('fenced' if not)
# and its record has not expired ('lapsed': readers may have seen it gone and failed its work, so
# the process must rejoin with REJOIN_LUA, never resurrect the old epoch).
# A missing counter means Redis lost its data (restart without persistence): the first live
# incarnation to renew claims it again, so a Redis restart does not stop the fleet.
RENEW_LUA = """
local current = redis.call('GET', KEYS[2])
if not current then
  redis.call('SET', KEYS[2], ARGV[1])
elseif current ~= ARGV[1] then
  return 'fenced'
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  return 'lapsed'
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('SET', KEYS[4], ARGV[5], 'NX')
return 'renewed'
"""

# KEYS: record, epoch counter, index, incarnation. ARGV: old epoch, value (carrying old epoch + 1),
# lease ms, id, writer's token.
# A lapsed process takes the next epoch, unless a newer start already took it ('fenced').
REJOIN_LUA = """
local current = redis.call('GET', KEYS[2])
if current and current ~= ARGV[1] then return 'fenced' end
redis.call('SET', KEYS[2], tonumber(ARGV[1]) + 1)
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('SET', KEYS[4], ARGV[5], 'NX')
return 'renewed'
"""

# KEYS: record, epoch counter. ARGV: epoch. Deletes the record only if we still own it.
RELEASE_LUA = """
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""
