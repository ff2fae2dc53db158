"""A job's state: one type for the agent, the coordinator and the CLIs.

On the wire it is the proto enum `ckptd.v1.JobState` (`JOB_STATE_<NAME>`);
in Python it is `JobState`, whose value is the lower-case name that the CLIs
print (`ckptctl status`, `--json`) and job records store.  A protobuf
message holds the number: `JobState.of(status.state)` reads it,
`JobState.RUNNING.pb` writes it.

Transitions (an agent's job: agent/runtime.py, checkpoint.py, restore.py;
the coordinator adds LOST and sums ranks up in coordinator/ranks.py):

    STARTING ──▶ RUNNING ◀──▶ CHECKPOINTING      a round parks, writes, resumes
                    │                            (an aborted round goes back too)
                    ▼
      EXITED | FAILED | KILLED | STOPPED         the incarnation ended: by itself,
                    │                            unexpectedly, `ckptctl kill`, or a
                    │                            preemption's final checkpoint
                    ▼
                RESTORING ──▶ RUNNING            `ckptctl restart` (a failed one: FAILED)

    any ──▶ LOST       the job's node stopped answering, or the coordinator
                       restarted without it; a later report or a restart
                       replaces it
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when used: `ckptctl jobs` with no daemon reads no protobuf
    from ckptd.v1 import ckptd_pb2 as pb

_PREFIX = "JOB_STATE_"


class JobState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    RESTORING = "restoring"
    EXITED = "exited"
    FAILED = "failed"
    KILLED = "killed"
    STOPPED = "stopped"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value

    @property
    def pb(self) -> pb.JobState:
        from ckptd.v1 import ckptd_pb2 as pb

        state: pb.JobState = getattr(pb, _PREFIX + self.name)
        return state

    @classmethod
    def of(cls, value: int) -> JobState:
        """The state a protobuf field holds (an unset one reads as LOST: no
        report says otherwise)."""
        from ckptd.v1 import ckptd_pb2 as pb

        if value == pb.JOB_STATE_UNSPECIFIED:
            return cls.LOST
        return cls[pb.JobState.Name(value).removeprefix(_PREFIX)]

    @property
    def live(self) -> bool:
        """The job's processes exist (or are being made)."""
        return self in LIVE

    @property
    def ended(self) -> bool:
        """Ended for good: nothing restarts it unless asked (`ckptctl restart`)."""
        return self in ENDED


LIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.CHECKPOINTING, JobState.RESTORING})
ENDED = frozenset({JobState.EXITED, JobState.KILLED, JobState.STOPPED})
# what an incarnation cannot leave again (a restart makes a new one)
FINAL = ENDED | {JobState.FAILED}
# a restart may take over without --force
RESTARTABLE = frozenset({JobState.FAILED, JobState.LOST})
