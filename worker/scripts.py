"""Lua scripts that make a job's writes conditional on who holds its lease (fencing).

A worker writes a job's events only while it holds the job's lease (value: its token, worker id + try).
A worker that lost its lease -- paused, partitioned, or reaped -- cannot publish over the job's next run.
The reaper writes only while *no one* holds the lease (token ""). Each call touches one job's keys, which
share the ``{rid}`` hash tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

__all__ = ["EMIT", "REFRESH", "Script"]

# KEYS: lease, log, cancel, running. ARGV: token, channel, log ttl, mode, rid, then (entry id, json)*.
# mode "": more to come; "end": terminal (drop lease, cancel key, running entry); "release": the job goes
# back to the queue (drop lease and running entry). Returns 1 if written, 0 if fenced. An entry id already
# in the log (a duplicate) is skipped, not published. (`running` is one global key: not Redis Cluster-ready.)
EMIT = """
local holder = redis.call('GET', KEYS[1])
if ARGV[1] == '' then
  if holder then return 0 end
elseif holder ~= ARGV[1] then
  return 0
end
for i = 6, #ARGV, 2 do
  local ok = redis.pcall('XADD', KEYS[2], ARGV[i], 'e', ARGV[i + 1])
  if type(ok) ~= 'table' or not ok.err then
    redis.call('PUBLISH', ARGV[2], ARGV[i + 1])
  end
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
if ARGV[4] == 'end' then
  redis.call('DEL', KEYS[3])
end
if ARGV[4] ~= '' then
  redis.call('HDEL', KEYS[4], ARGV[5])
  if ARGV[1] ~= '' then redis.call('DEL', KEYS[1]) end
end
return 1
"""

# KEYS: lease. ARGV: token, ttl ms. Extends the lease if still ours: 1, else 0.
REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script called by SHA inside pipelines (no per-pipeline SCRIPT EXISTS round trip)."""

    source: str
    sha: str

    @classmethod
    async def load(cls, redis: Redis, source: str) -> Script:
        return cls(source, await redis.script_load(source))

    async def reload(self, redis: Redis) -> None:
        """After a Redis restart emptied the script cache."""
        await redis.script_load(self.source)

    def call(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        pipe.evalsha(self.sha, len(keys), *keys, *args)


def is_noscript(result: object) -> bool:
    return isinstance(result, NoScriptError)
