"""The per-node agent: its jobs, its shim socket, and its link to the coordinator."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

from ckptd import faults, limits
from ckptd.errors import CkptdError, Code
from ckptd.image import core
from ckptd.image.checksum import IdentityCache
from ckptd.image.manifest import RankPart
from ckptd.jobstate import LIVE, JobState
from ckptd.paths import Home, storage_error, write_private
from ckptd.rpc import call, coordinator_stub
from ckptd.v1 import ckptd_pb2 as pb

from . import rank_net
from .checkpoint import Checkpointer
from .health import node_health
from .owner import Owner, check_storage, resolve_owner
from .owner import shim_socket as owner_shim_socket
from .preload import check_preloadable
from .progress import Transfers
from .restore import check_checkpoint_dir, restore_job, resume_restored, verify_checkpoint
from .rollback import WorldRollback
from .runtime import Incarnation, JobRuntime, job_dir_of, spec_from_json, spec_to_json
from .shim_link import Message, ShimConnection, ShimServer

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0


def _fill(arg: str, spec: pb.JobSpec) -> str:
    """{rank}, {nranks} and {master_addr} in a rank's command line."""
    if not spec.rank.job:
        return arg
    master = next((r.vip for r in spec.rank.ranks if r.rank == 0), "")
    return (
        arg.replace("{rank}", str(spec.rank.rank))
        .replace("{nranks}", str(len(spec.rank.ranks)))
        .replace("{master_addr}", master)
    )


def check_names(spec: pb.JobSpec) -> None:
    """A job's names become paths on this node (its checkpoint and runtime
    directories): whoever calls, a name that could leave them ('/', '..')
    is refused here (INVALID_ARGUMENT)."""
    if spec.rank.job:
        limits.check_job_name(spec.rank.job)
        valid = spec.name == f"{spec.rank.job}@{spec.rank.rank}"
    else:
        valid = limits.valid_job_name(spec.name)
    if not valid:
        limits.check_job_name(spec.name)  # raises: says what a name may be
    if not os.path.isabs(spec.ckpt_dir):
        raise CkptdError(Code.INVALID_ARGUMENT, f"the checkpoint directory {spec.ckpt_dir!r} is not an absolute path")


class AgentNode:
    def __init__(self, home: Home, node: str, address: str, coordinator: str, ip: str = "") -> None:
        self.home = home
        self.node = node
        self.address = address
        self.ip = ip  # this node's address between nodes (ranks' traffic is routed to it)
        self.coordinator_address = coordinator
        self.jobs: dict[str, JobRuntime] = {}
        self.lock = threading.Lock()
        self.identities = IdentityCache()
        self.transfers = Transfers()  # bytes moved by each job's checkpoint or restart in flight
        self.checkpointer = Checkpointer(self.identities, self.transfers)
        self.shim_server = ShimServer(home.shim_socket(node), self._on_hello, self._on_close, on_term=self._on_term)
        self.draining = False  # the embedded daemon got SIGTERM: its jobs' held SIGTERMs wait for final checkpoints
        self.owner_shims: dict[int, ShimServer] = {}  # jobs of other users: one socket per user (owner.py)
        self._coordinator = coordinator_stub(coordinator)
        self._stop = threading.Event()
        self._events: list[pb.JobStatus] = []
        self._events_cv = threading.Condition()
        self._coordinator_instance = ""
        # restored ranks rebuilt and parked, waiting for the other ranks (Restore hold)
        self.held: dict[str, list[ShimConnection]] = {}

    # ---- lifecycle ----

    def start(self) -> None:
        core.warm()  # not in a job's first pause
        self.home.agent_dir(self.node).mkdir(parents=True, exist_ok=True)
        self._readopt()
        with self.lock:
            busy = {name for name, job in self.jobs.items() if job.state is JobState.RUNNING}
        # restarts a dead agent left half done (their processes never ran; an adopted one
        # still RESTORING is being killed): what they changed goes back
        WorldRollback.replay_leftovers(self.home.agent_dir(self.node) / "jobs", busy)
        self._sweep_relay_sockets()
        self.shim_server.start()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self._event_loop, name="events", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.shim_server.stop()
        for server in list(self.owner_shims.values()):
            server.stop()
        with self._events_cv:
            self._events_cv.notify_all()

    def _register(self) -> bool:
        try:
            reply = call(
                self._coordinator.RegisterNode,
                pb.RegisterNodeRequest(
                    node=self.node,
                    address=self.address,
                    uid=os.getuid(),
                    ip=self.ip,
                    health=node_health(self.node),
                ),
                5,
                "coordinator",
            )
        except CkptdError as e:
            log.warning("cannot register with the coordinator at %s: %s", self.coordinator_address, e)
            self._abandon_rounds("the coordinator is unreachable")
            return False
        if self._coordinator_instance and reply.instance != self._coordinator_instance:
            self._abandon_rounds("the coordinator restarted")
            self._drop_held("the coordinator restarted during its restart")
        self._coordinator_instance = reply.instance
        for job in list(self.jobs.values()):
            self._queue_event(job.status())
        return True

    def _heartbeat_loop(self) -> None:
        registered = False
        while not self._stop.is_set():
            if not registered:
                registered = self._register()
            else:
                try:
                    call(
                        self._coordinator.Heartbeat,
                        pb.HeartbeatRequest(node=self.node, health=node_health(self.node)),
                        5,
                        "coordinator",
                    )
                except CkptdError as e:
                    # the coordinator restarted or is gone: register again
                    log.warning("heartbeat failed: %s", e)
                    registered = e.code is not Code.NOT_FOUND and e.code is not Code.UNAVAILABLE
                    if e.code is Code.UNAVAILABLE:
                        self._abandon_rounds("the coordinator is unreachable")
            self._stop.wait(HEARTBEAT_S)

    def launcher_gone(self, job: JobRuntime) -> None:
        """The foreground launcher of job died: the coordinator takes a final
        checkpoint and stops the job (Coordinator.final_stop)."""
        log.warning("job %s: its launcher is gone; asking the coordinator for a final checkpoint", job.name)

        threading.Thread(
            target=self._report_event,
            args=(job, "tell the coordinator its launcher is gone"),
            kwargs={"launcher_gone": True},
            name=f"launcher-gone-{job.name}",
            daemon=True,
        ).start()

    def _queue_event(self, status: pb.JobStatus) -> None:
        with self._events_cv:
            self._events.append(status)
            self._events_cv.notify_all()

    def _event_loop(self) -> None:
        """Report job changes in order, outside any job lock."""
        while not self._stop.is_set():
            with self._events_cv:
                while not self._events and not self._stop.is_set():
                    self._events_cv.wait(1.0)
                events, self._events = self._events, []
            for status in events:
                with contextlib.suppress(CkptdError):
                    call(
                        self._coordinator.ReportJobEvent,
                        pb.JobEvent(node=self.node, status=status),
                        5,
                        "coordinator",
                    )

    def _abandon_rounds(self, why: str) -> None:
        """A checkpoint round whose coordinator is gone can never finish: the
        parked jobs run on (the coordinator discards the half-written
        checkpoint when it comes back)."""
        for name in self.checkpointer.parked_jobs():
            with contextlib.suppress(CkptdError):
                log.warning("job %s: abandoning its checkpoint round: %s", name, why)
                self.checkpointer.abort(self.get(name))

    def _drop_held(self, why: str) -> None:
        """Ranks rebuilt for a restart that its coordinator forgot: none may run
        alone, so they go (the job is failed and can be restarted again)."""
        for name in list(self.held):
            self.held.pop(name, None)
            with contextlib.suppress(CkptdError):
                log.warning("job %s: dropping its rebuilt processes: %s", name, why)
                self.get(name).kill(requested=False)

    def _on_change(self, job: JobRuntime) -> None:
        with self.lock:
            current = self.jobs.get(job.name) is job
        if job.netns and job.state not in LIVE and current:
            # the rank's processes are gone: so is its address on this node
            # (unless a restore already made the namespace again, under the
            # same name, for the rank's next incarnation)
            rank = job.spec.rank
            with contextlib.suppress(rank_net.RankNetError, OSError):
                rank_net.delete_rank_netns(self.node, rank.job, rank.rank)
            job.netns = ""
        self._queue_event(job.status())

    # ---- shim connections ----

    def _on_hello(self, conn: ShimConnection) -> None:
        with self.lock:
            job = self.jobs.get(conn.job)
        if job is None:
            conn.drop_pidfd()
            log.warning("process %d says it belongs to unknown job %r; ignoring it", conn.host_pid, conn.job)
            return
        try:
            why = job.refuses(conn)  # SO_PEERCRED: its uid, and its place in the job's process tree
        finally:
            conn.drop_pidfd()  # needed only there
        if why:
            log.warning("process %d says it belongs to job %s, but %s; ignoring it", conn.host_pid, job.name, why)
            conn.close()
            return
        with job.cond:
            # A process that exec'd said HELLO twice on two connections (the
            # first, close-on-exec, from before the exec), and the two greeters
            # may get here in either order: a connection whose process already
            # closed it never replaces the one it has now (it would be dropped
            # at its close, and the process seen as outside the shim).
            if conn.gone():
                return
            job.shims[conn.host_pid] = conn
            job.cond.notify_all()
        # no event for the coordinator: a job that forks hundreds of short-lived
        # children a second would keep the agent busy reporting them (pids are
        # read live by GetJob)
        log.debug(
            "job %s: process %d (pid %d in the job) registered%s",
            job.name,
            conn.host_pid,
            conn.pid,
            " after restore" if conn.restored else "",
        )

    def _on_term(self, conn: ShimConnection, msg: Message) -> None:
        """A process of a job holds a SIGTERM at its default disposition
        (native/shim/sigterm.c): hold it for a final checkpoint, after which
        the job stops, when the job's launcher says so (its SIGTERM policy)
        or this embedded daemon is itself draining; deliver it otherwise
        (--sigterm forward, no launcher, a SIGTERM ckptd itself passes on)."""
        with self.lock:
            job = self.jobs.get(conn.job)
        hold = job is not None and job.term_held(self.draining, msg.int("sender"))
        log.warning(
            "job %s: process %d got SIGTERM (from pid %s): %s",
            conn.job,
            conn.host_pid,
            msg.fields.get("sender", "?"),
            "holding it for a final checkpoint" if hold else "delivering it",
        )
        with contextlib.suppress(CkptdError):
            conn.request("TERM_HOLD" if hold else "TERM_DELIVER", 30)
        if not hold or job is None or not job.first_term_of_incarnation():
            return
        # the final checkpoint, unless the launcher's or the daemon's own gets there first
        self._report_event(job, "ask the coordinator for a final checkpoint", sigterm=True)

    def _report_event(self, job: JobRuntime, what: str, **flags: bool) -> None:
        """A JobEvent with these flags to the coordinator, tried 5 times, 2 s apart."""
        for _ in range(5):
            try:
                event = pb.JobEvent(node=self.node, status=job.status(), **flags)
                call(self._coordinator.ReportJobEvent, event, 10, "coordinator")
                return
            except CkptdError as e:
                log.warning("job %s: cannot %s: %s", job.name, what, e.message)
                self._stop.wait(2.0)

    def _on_close(self, conn: ShimConnection) -> None:
        with self.lock:
            job = self.jobs.get(conn.job)
        if job is None:
            return
        with job.cond:
            if job.shims.get(conn.host_pid) is conn:
                del job.shims[conn.host_pid]
            job.cond.notify_all()

    # ---- jobs ----

    def _spec_file(self, name: str) -> Path:
        return self.home.agent_dir(self.node) / "jobs" / name / "spec.json"

    def _shim_socket(self, job: JobRuntime) -> None:
        """Another user's job reaches the agent through that user's own shim socket."""
        owner = job.owner
        if not owner.switch and not owner.any_uid:
            return
        with self.lock:
            server = self.owner_shims.get(owner.uid)
            if server is None:
                path = owner_shim_socket(self.home, self.node, owner)
                # a root job's processes may have dropped to any uid: every uid may
                # connect, and JobRuntime.refuses checks each is a process of the job
                server = ShimServer(
                    path,
                    self._on_hello,
                    self._on_close,
                    owner=(owner.uid, owner.gid),
                    any_uid=owner.any_uid,
                    on_term=self._on_term,
                )
                server.start()
                self.owner_shims[owner.uid] = server
        job.shim_socket = server.path

    def _track(self, spec: pb.JobSpec, owner: Owner | None = None) -> JobRuntime:
        job = JobRuntime(self.home, self.node, spec, self._on_change, owner)
        self._shim_socket(job)
        path = self._spec_file(spec.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(spec_to_json(spec))
        with self.lock:
            self.jobs[spec.name] = job
        return job

    def _readopt(self) -> None:
        """Jobs whose ckptd-init outlived the previous agent come back under this one."""
        base = self.home.agent_dir(self.node) / "jobs"
        for spec_file in sorted(base.glob("*/spec.json")):
            try:
                spec = spec_from_json(spec_file.read_text())
                gens = sorted(
                    spec_file.parent.glob("gen-*"),
                    key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else -1,
                )
                if not gens:
                    continue
                inc = Incarnation.load(gens[-1])
            except (OSError, ValueError, TypeError) as e:
                log.warning("cannot read %s: %s", spec_file, e)
                continue
            try:
                job = JobRuntime(self.home, self.node, spec, self._on_change)
                self._shim_socket(job)
            except CkptdError as e:
                log.warning("cannot re-adopt job %s: %s", spec.name, e.message)
                continue
            if job.adopt(inc):
                with self.lock:
                    self.jobs[spec.name] = job
                log.info("re-adopted job %s (generation %d)", spec.name, inc.generation)

    def _sweep_relay_sockets(self) -> None:
        """A relay killed with its machine (or kill -9) leaves its control
        socket behind in the runtime directory: one nobody listens on goes."""
        for path in self.home.run_dir.glob("init-*.sock"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1)
                try:
                    s.connect(str(path))
                except ConnectionRefusedError:
                    with contextlib.suppress(OSError):
                        path.unlink()
                        log.info("removed %s: its relay is gone", path.name)
                except OSError:
                    pass

    def get(self, name: str) -> JobRuntime:
        with self.lock:
            job = self.jobs.get(name)
        if job is None:
            raise CkptdError(Code.NOT_FOUND, f"job {name} is not on node {self.node}")
        return job

    def start_job(self, spec: pb.JobSpec) -> JobRuntime:
        check_names(spec)
        owner = resolve_owner(spec.owner, self.node)  # before anything is made for the job
        if not spec.argv:
            raise CkptdError(Code.INVALID_ARGUMENT, "no command to run")
        with self.lock:
            old = self.jobs.get(spec.name)
        if old is not None and old.alive():
            raise CkptdError(Code.ALREADY_EXISTS, f"job {spec.name} is already running on {self.node}")
        check_preloadable(spec.argv[0], spec.env.get("PATH", ""), spec.cwd or "/", owner.uid, owner.gid)
        jd = job_dir_of(spec)
        check_storage(Path(spec.ckpt_dir), owner, self.node)
        jd.ensure(spec.ckpt_dir, owner.uid)
        for f in (jd.log, jd.index):  # a fresh start (an ended job replaced by launch --resume): a fresh log
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        try:
            write_private(jd.spec_file, spec_to_json(spec))
        except OSError as e:
            raise storage_error(e, f"cannot write {jd.spec_file}") from e
        job = self._track(spec, owner)
        job.forget_incarnations()  # a fresh job: generation 0, not the replaced job's next
        job.netns = self._rank_network(spec, carrier=True)
        job.spawn([_fill(a, spec) for a in spec.argv], restore=False)
        return job

    def _rank_network(self, spec: pb.JobSpec, carrier: bool) -> str:
        """A rank's network namespace with its virtual IP, and routes to the
        job's other ranks through their nodes; "" for a classic job."""
        rank = spec.rank
        if not rank.vip:
            return ""
        remote = [r for r in rank.ranks if r.node != self.node]
        if remote and not self.ip:
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"node {self.node} has no address for traffic between nodes; start its agent with --ip ADDRESS",
            )
        for r in remote:
            if not r.node_ip:
                raise CkptdError(
                    Code.FAILED_PRECONDITION,
                    f"node {r.node} (rank {r.rank}) has no address for traffic between nodes; "
                    "start its agent with --ip ADDRESS",
                )
        try:
            rank_net.enable_forwarding()
            rank_net.reserve_vips([r.vip for r in rank.ranks])
            path = rank_net.create_rank_netns(self.node, rank.job, rank.rank, rank.vip, carrier)
            rank_net.set_job_routes(self.ip, [rank_net.RankAddress(r.rank, r.vip, r.node_ip) for r in remote])
        except (rank_net.RankNetError, OSError) as e:
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"cannot give rank {rank.rank} of job {rank.job} its network on {self.node}: {e}",
            ) from e
        return path

    def restore(
        self, spec: pb.JobSpec, checkpoint: Path, allow_changed: bool, hold: bool = False, lazy: bool = False
    ) -> JobRuntime:
        check_names(spec)
        owner = resolve_owner(spec.owner, self.node)
        with self.lock:
            job = self.jobs.get(spec.name)
        if job is not None and job.alive():
            raise CkptdError(
                Code.FAILED_PRECONDITION,
                f"job {spec.name} is still running on {self.node} (pids {job.live_pids()}); "
                "use --force to kill it first",
            )
        try:
            check_checkpoint_dir(spec, checkpoint)  # the job's own checkpoint, in its own directory
            verified = verify_checkpoint(spec.name, checkpoint, allow_changed, self.identities, self.transfers)
        except OSError as e:  # the storage failed under the reads: say which file, not "internal error"
            raise _unreadable(checkpoint, e) from e
        faults.point("verify", "agent")
        job = self._track(spec, owner)
        try:
            job_dir_of(spec).ensure(spec.ckpt_dir, owner.uid)
            # a rank's link stays down until every rank is rebuilt: no segment
            # may reach a peer whose connection does not exist yet (a reset)
            job.netns = self._rank_network(spec, carrier=not hold)
            try:
                held = restore_job(self.home, job, verified, self.transfers, hold=hold, lazy=lazy)
            except OSError as e:
                raise _unreadable(checkpoint, e) from e
            if held is not None:
                self.held[spec.name] = held
        except CkptdError as e:
            with job.cond:
                if job.incarnation is None:  # failed before anything was started
                    job.state, job.message = JobState.FAILED, f"restart failed: {e.message}"
            self._on_change(job)
            raise
        self._on_change(job)
        return job

    def job_status(self, job: JobRuntime) -> pb.JobStatus:
        """The job's status with the progress of what it has in flight."""
        st = job.status()
        progress = self.transfers.snapshot(job.name)
        if progress is not None:
            st.progress.CopyFrom(progress)
        return st

    def statuses(self) -> list[pb.JobStatus]:
        with self.lock:
            jobs = list(self.jobs.values())
        return [self.job_status(j) for j in jobs]

    def health(self) -> pb.NodeHealth:
        h = node_health(self.node)
        h.address = self.address
        h.ip = self.ip
        return h

    def release(self, job: JobRuntime) -> bool:
        """Let a held restored rank go: its link up, then its processes."""
        conns = self.held.pop(job.name, None)
        if conns is None:
            return False
        if job.netns:
            try:
                rank_net.set_carrier(self.node, job.spec.rank.job, job.spec.rank.rank, True)
            except (rank_net.RankNetError, OSError) as e:
                raise CkptdError(Code.INTERNAL, f"cannot bring job {job.name}'s link up: {e}") from e
        resume_restored(job, conns, job.incarnation.restored_from if job.incarnation else "?")
        self._on_change(job)
        return True

    def manifest_part(self, job: JobRuntime, request: pb.FinalizeRequest) -> RankPart:
        return self.checkpointer.finalize(job, request.dir, request.dedup_with, request.dedup_with_final)


def _unreadable(checkpoint: Path, e: OSError) -> CkptdError:
    """A restart whose storage failed under it (EIO, a vanished mount)."""
    where = e.filename or checkpoint
    return CkptdError(
        Code.UNAVAILABLE,
        f"cannot restart from {checkpoint}: reading {where} failed: {e.strerror} (errno {e.errno}); "
        "fix the checkpoint storage and retry, or restart --from another checkpoint",
    )
