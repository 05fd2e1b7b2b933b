"""Every Redis key kvmesh writes, in one place.

    kvmesh:epoch:{kind}:{id}   INCR counter. Each start of a process takes the next value: its epoch,
                               a fencing token. A process whose epoch is no longer the counter's value
                               has been replaced and must stop renewing (and serving).
    kvmesh:svc:{kind}:{id}     JSON ServiceRecord (addresses, model info, load), SET ... PX lease_ms,
                               renewed by every heartbeat only while the epoch still matches (Lua).
                               Gone == dead: readers treat a missing record as a failed process.
    kvmesh:svcs:{kind}         SET of ids ever registered of this kind (discovery index; members whose
                               record has expired are pruned by readers).

    kind: worker | tokenizer | scheduler | gateway | prefix-cache

The prefix-cache service's block-ownership keys (block -> owners, worker -> blocks) are described
with their protocol in docs/kv_events.md; they are purged when a worker's record expires.
Reserved for later: kvmesh:tenant:{tenant}:tokens (token buckets), kvmesh:handoff:{request} (P->D leases).
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


# KEYS: record, epoch counter, index. ARGV: epoch, value, lease ms, id.
# Renews only while this process's epoch is still the newest one; returns 1 if renewed, 0 if fenced.
# A missing counter means Redis lost its data (restart without persistence): the first live
# incarnation to renew claims it again, so a Redis restart does not stop the fleet.
RENEW_LUA = """
local current = redis.call('GET', KEYS[2])
if not current then
  redis.call('SET', KEYS[2], ARGV[1])
  current = ARGV[1]
end
if current ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
return 1
"""

# KEYS: record, epoch counter. ARGV: epoch. Deletes the record only if we still own it.
RELEASE_LUA = """
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""
