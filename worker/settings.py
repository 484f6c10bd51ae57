"""Worker settings, read from AOTC_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from compiler.errors import AotcError
from compiler.targets import Target
from service.store.blobstore.settings import StorageSettings
from service.store.redis_url import with_password_file


class WorkerSettings(StorageSettings):
    model_config = SettingsConfigDict(env_prefix="AOTC_", extra="ignore")

    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="The service's Redis.")
    redis_password_file: Path | None = Field(
        default=None, description="A file holding Redis's password (e.g. a Docker secret), for an AOTC_REDIS_URL "
        "without one; a password in the URL wins.")
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N. One worker process per GPU.")
    worker_targets: list[str] = Field(
        default_factory=list, description="The CPU targets this worker serves, e.g. [\"cpu-x86_64-v3\"] (aliases "
        "such as cpu-x86_64-avx2 allowed). Empty: every x86-64 level at or below the host's (an AVX-512 host serves "
        "v4, v3, v2 and v1). A level above the host's stops the worker at start. Ignored by GPU workers.")
    build_only_targets: list[str] = Field(
        default_factory=list, description="Targets this worker builds but does not serve natively, e.g. "
        "[\"cpu-x86_64-v3\"] on a v4 host, or an older GPU architecture where the toolchain can emit it: its check "
        "runs on this worker's own device, not on the target, so it publishes the artifact marked 'built, not run "
        "on target' (in the record and the signed manifest) and queues a verify job that only a worker serving the "
        "target natively takes; that worker checks it there and countersigns. Lookup serves such an artifact only "
        "when asked (allow_unverified) until then. Each must be a target this worker serves (AOTC_WORKER_TARGETS); "
        "it never takes verify jobs for them.")
    isa_scan_timeout_s: float = Field(
        default=120.0, gt=0, description="How long a CPU compile may spend disassembling its package to check that "
        "no instruction above its x86-64 level is in it (compiler.isa); past it the scan stops, and the report "
        "says it is incomplete. The flags check always runs.")
    weights_max_header_mb: int = Field(
        default=64, gt=0, le=1024, description="The largest safetensors header a weights blob may have (its JSON "
        "list of tensors; 64 MiB holds about 500k): the worker's publish, its check children, the SDK and the "
        "loader refuse a blob whose header claims more. Read from the environment where a client reads a blob.")
    work_dir: Path = Field(default=Path(".aotc/work"), description="Scratch space for compiles.")
    compile_timeout_s: float = Field(default=1800.0, gt=0, description="A compile running longer is killed.")
    check_timeout_s: float = Field(default=600.0, gt=0, description="An artifact check running longer is killed.")
    check_early: Literal["auto", "on", "off"] = Field(
        default="auto", description="Start each job's check beside its compile (worker/earlycheck.py): the check "
        "child imports torch, loads the program on the device, runs it eagerly and decides eager's verdict on the "
        "adversarial cases while the compile runs, then waits for the package; its time limit "
        "(AOTC_CHECK_TIMEOUT_S) starts when the package comes. The device holds the program's weights twice "
        "meanwhile (the compile's copy and the check's). auto: on a CUDA device (on a CPU device the two would "
        "share the same cores). Never for train steps (mode=training). A job's check.early says what it saved.")
    heartbeat_s: float = Field(default=5.0, gt=0, description="Registry and lease renewal period.")
    lease_s: float = Field(
        default=30.0, gt=0, description="A claimed job whose lease is not renewed this long is reclaimed."
    )
    reap_interval_s: float = Field(default=5.0, gt=0, description="How often this worker looks for expired leases.")
    worker_ttl_s: float = Field(default=15.0, gt=0, description="Registry entry lifetime without a heartbeat.")
    batch_max_wait_s: float = Field(
        default=600.0, gt=0, description="A batch job queued longer than this is served before interactive ones."
    )
    poll_ms: int = Field(default=2000, gt=0, description="How long one queue read blocks.")
    child_ld_preload: str = Field(
        default="", description="LD_PRELOAD for compile/check children (some images need their system libstdc++)."
    )
    share_gemm_timings: bool = Field(
        default=True, description="Share max-autotune's matmul/conv timings with other workers through redis_url "
        "(the worker seeds and reads each compile's timings file; compile children never reach Redis)."
    )
    check_exclusive: bool = Field(
        default=True, description="One timing pass at a time per device among the workers sharing AOTC_DATA_DIR (a "
        "lock file in AOTC_DATA_DIR/locks), so that the latency figures deploy-time lookup ranks artifacts by are "
        "taken on a quiet device. The correctness check runs beside compiles and other checks, without it; the "
        "timing pass that follows (compiler/timing.py) takes it. A worker waits at most AOTC_CHECK_TIMEOUT_S for "
        "it, then times anyway; the record's check.timing says whether it held the device, the wait, the load.")
    timing_pass: Literal["alone", "separate", "auto"] = Field(
        default="alone", description="Where an artifact's latency figures come from. separate: the check runs "
        "beside compiles and other checks, untimed, then a timing pass of its own (compiler/timing.py) times eager, "
        "the package and its graph replay under the device lock (AOTC_CHECK_EXCLUSIVE); for farms, where one "
        "check at a time would set the pace. auto: a check that finds the device lock free times itself under it "
        "(one child fewer, for a worker alone on its device), else as separate. alone: as auto while the registry "
        "shows no other live worker on this host and device, else as separate. The record's check.timing says "
        "which ran.")
    timing_windows: int = Field(
        default=1, ge=1, le=16, description="Each latency figure taken in this many windows (each 1/N of the calls), "
        "interleaved in rounds, and the window with the smallest median kept, with every window's median beside it "
        "(compiler/timing.py). On one H200 eager's figure followed the moment it was taken, by a median 1.4-1.5x "
        "on every core, while its smallest held (bench/host_noise.py). Above 1 the figures always come from the "
        "timing pass, never the check (as AOTC_TIMING_PASS=separate). 1: one window, the median, as do_bench. "
        "For a farm of workers on one GPU, 5: there the timing pass runs anyway, and with 5 the workers' figures "
        "were within 10 % of the quieter of two quiet runs on 8, 9 and 10 of 10 (eager, plain, graphs; "
        "bench/README.md).")
    timing_cpus: str = Field(
        default="auto", description="Cores kept for the timing pass (worker/cpus.py): the timing child runs on them "
        "and every other child (compiles, untimed checks) on the rest, so that eager's figures, which the host's "
        "load sets at a serving batch, are not taken beside compiles. auto: on a CUDA device with at least 8 cores, "
        "the last 2 physical cores, each with its SMT siblings (sysfs); on a CPU device none. A list (14-15, 3,7): "
        "those cores. off: no split. The record's check.timing.cores says which cores each child ran on.")
    timing_pause: Literal["auto", "always", "off"] = Field(
        default="auto", description="While a worker's timing pass holds the device lock (AOTC_CHECK_EXCLUSIVE), the "
        "other workers' compile and warm-up children on that device stop (SIGSTOP, with everything they started) "
        "and go on when it ends, their time limits standing still meanwhile (AOTC_TIMING_PAUSE_MAX_S in all); and "
        "their checks hold the device shared, so that none runs beside a timing pass and none starts while one "
        "waits (a check is never stopped: its probes keep wall-clock limits). On a CPU device the device is the "
        "host: a compile or check beside the timing pass on the same cores put eager's figure off by up to 140x on "
        "the 2-core box. auto: on a CPU device (a CUDA worker keeps cores for the timing instead: "
        "AOTC_TIMING_CPUS); always: on every device; off: nothing pauses or waits. The job's timings say how long "
        "its compile was paused (compile_paused), the record's check.timing whether compiles paused for its figures "
        "(compiles).")
    timing_pause_max_s: float = Field(
        default=300.0, ge=0, description="The longest a compile is kept paused in all (AOTC_TIMING_PAUSE): a timing "
        "pass that hangs holding the device lock must not hold the compiles with it.")
    keep_work: bool = Field(default=False, description="Keep each job's scratch folder (logs, package) for debugging.")
    retry_backoff_s: float = Field(
        default=10.0, ge=0, description="A job whose attempt failed and may be retried waits this long before its "
        "next attempt, doubled per attempt it has used, at most AOTC_RETRY_BACKOFF_MAX_S, half of it random "
        "(jitter); 0: at once. A lost worker's job comes back at once (its lease was the wait).")
    retry_backoff_max_s: float = Field(default=300.0, ge=0, description="The longest wait between two attempts.")
    verify_max_attempts: int = Field(
        default=10, ge=1, description="Attempts of a verify job (the check on target of a package built elsewhere) "
        "this worker queues. Its failures other than a failed check are the machine's (a crash, a timeout, a lost "
        "worker), so it keeps trying longer than a compile, waiting up to AOTC_VERIFY_BACKOFF_MAX_S between "
        "attempts; one that used them all is queued again by the next worker that starts serving its target.")
    verify_backoff_max_s: float = Field(
        default=3600.0, ge=0, description="The longest wait between two attempts of a verify job.")
    worker_max_early_crashes: int = Field(
        default=3, ge=1, description="After this many compile or check children in a row fail before their work "
        "starts (while importing torch, or before), the worker stops claiming jobs and reports itself unhealthy; "
        "the jobs it failed that way go back without spending an attempt.")
    worker_device_recheck: Literal["auto", "always", "off"] = Field(
        default="auto", description="After a compile, check or timing child fails once its work started, a probe "
        "child (import torch, touch the device) tells whether the device still works: where it does not (a GPU "
        "that fell off the bus mid-check), the failure is the device's, so the job goes back unspent (once) and the "
        "worker is unhealthy until a reprobe gets through. auto: on CUDA devices; always: on the CPU too; off.")
    worker_reprobe_s: float = Field(
        default=300.0, ge=0, description="An unhealthy worker runs a probe child (import torch, touch the device) "
        "this often and serves again once one passes; 0: it stays unhealthy until restarted.")
    data_dir: Path = Field(
        default=Path(".aotc"), description="The service's data dir (the embedded Redis's data, uploads), read here "
        "only to hide it from compile and check children."
    )

    signing_key_file: Path | None = Field(
        default=None, description="The Ed25519 private key (PEM, PKCS#8, unencrypted) this worker signs artifact "
        "manifests with. Unset: AOTC_DATA_DIR/signing/worker-ed25519.pem, made on first start (mode 0600) and kept. "
        "It must sit where compile and check children cannot see it: under AOTC_DATA_DIR, /run (e.g. "
        "/run/secrets) or an AOTC_SANDBOX_HIDE dir; the worker refuses to start otherwise."
    )

    # -- the sandbox of compile and check children (worker/isolation.py) ----------------------------------------
    sandbox: Literal["on", "off"] = Field(
        default="on", description="on: compile and check children run in a bubblewrap sandbox (an unprivileged "
        "uid, no network, a private writable dir, resource limits); the worker refuses to start if it cannot set "
        "one up. off: children run unconfined, with a warning on every job; only for trusted models."
    )
    sandbox_bwrap: str = Field(default="bwrap", description="The bubblewrap binary: a path, or a name on PATH.")
    sandbox_uid: int = Field(
        default=65534, ge=1, description="The uid children run as when the worker runs as root (with "
        "AOTC_SANDBOX_BOUNDS=uid, the pool AOTC_SANDBOX_UID_POOL_START.. instead)."
    )
    sandbox_gid: int | None = Field(default=None, ge=1, description="The children's gid (default: the uid's group).")
    sandbox_hide: list[Path] = Field(
        default_factory=list, description="More paths to hide from children (an empty tmpfs over each), e.g. where "
        "keys live. Children see only the system dirs, Python, this checkout, PYTHONPATH and AOTC_SANDBOX_MOUNT; "
        "this hides what lies under those. The work, data and headers dirs and the worker's home are always hidden."
    )
    sandbox_mount: list[Path] = Field(
        default_factory=list, description="More paths children may read (bound read-only), besides /usr, /lib*, "
        "/bin, /sbin, a few files of /etc, Python, this checkout, PYTHONPATH, and for CUDA children /usr/local/cuda*, "
        "/dev/nvidia* and the GPUs' /sys dirs (docs/security.md lists them). E.g. a CUDA toolkit elsewhere."
    )
    sandbox_bounds: Literal["auto", "cgroup", "uid"] = Field(
        default="auto", description="How memory and processes are bounded per sandbox. cgroup: one cgroup per child "
        "(v2 where a subtree with the memory and pids controllers is delegated, else v1 where root can create "
        "groups), every process of the sandbox in it; the worker refuses to start without one. uid: each concurrent "
        "child runs as its own uid from AOTC_SANDBOX_UID_POOL_START (root only), so RLIMIT_NPROC counts per "
        "sandbox; memory is then RLIMIT_AS per process. auto: cgroup where possible, else uid, else the shared uid; "
        "the worker says at start which mechanism bounds what."
    )
    sandbox_cgroup: Path | None = Field(
        default=None, description="cgroup v2: the delegated cgroup (writable, memory and pids in its "
        "cgroup.subtree_control) that children's groups are made in; default: this worker's own cgroup. cgroup v1: "
        "unused (groups go to /sys/fs/cgroup/{memory,pids}/aotc/)."
    )
    sandbox_uid_pool_start: int = Field(
        default=200000, ge=1, description="With AOTC_SANDBOX_BOUNDS=uid (or auto without cgroups): the first uid of "
        "the pool children take their own uid from (host-wide, by a lock file in AOTC_SANDBOX_UID_LOCK_DIR)."
    )
    sandbox_uid_pool_size: int = Field(default=256, ge=1, description="How many uids that pool holds.")
    sandbox_uid_lock_dir: Path = Field(
        default=Path("/run/aotc-sandbox-uids"), description="Where workers on one host lock the pool's uids: the "
        "same dir for every worker of the host."
    )
    sandbox_seccomp: bool = Field(
        default=True, description="A seccomp filter in every child: namespace creation, mount, ptrace, bpf, keyctl, "
        "perf_event_open, io_uring, kexec, module loading and the like fail with EPERM (needs libseccomp). Off only "
        "to find out whether the filter breaks a toolchain."
    )
    headers_dir: Path | None = Field(
        default=None, description="Where the trusted precompiled headers live, built at start by a sandboxed "
        "compile of a built-in model and bound read-only into every compile (default: AOTC_WORK_DIR/headers)."
    )
    headers_warmup: Literal["background", "before"] = Field(
        default="background", description="When a worker builds the trusted precompiled headers it lacks. "
        "background: it takes jobs at once, and until the set is built (by the warm-up, in the background) its "
        "compiles run without precompiled headers, building none of their own; before: it takes no job until the "
        "set is built (81-127 s on a GPU machine). Either way only the warm-up's compile of a built-in model makes "
        "headers that other compiles include (worker/headers.py)."
    )
    compile_max_memory_gb: float = Field(
        default=16.0, ge=0, description="Memory of each compile or check sandbox, all its processes together "
        "(cgroup memory.max or memory.limit_in_bytes; its tmpfs counts too), CUDA children included; 0: none. "
        "Without cgroups: the address space (RLIMIT_AS) of each process of a CPU child, none for CUDA children "
        "(CUDA reserves far more address space than it uses)."
    )
    child_max_cpu_s: int = Field(
        default=36000, ge=0, description="CPU seconds (RLIMIT_CPU) of each process a compile or check child runs, "
        "all its threads together; 0: none. The wall-clock limits are AOTC_COMPILE_TIMEOUT_S and AOTC_CHECK_TIMEOUT_S."
    )
    child_max_file_mb: int = Field(
        default=16384, ge=0, description="Largest file a compile or check child may write (RLIMIT_FSIZE); 0: none."
    )
    child_max_disk_mb: int = Field(
        default=16384, ge=0, description="All a compile or check child writes, its files together: its writable dir "
        "is a tmpfs of this size (in memory, so it counts against AOTC_COMPILE_MAX_MEMORY_GB too), mounted by the "
        "worker when it runs as root with CAP_SYS_ADMIN; else only AOTC_CHILD_MAX_FILE_MB holds. 0: no tmpfs."
    )
    child_max_procs: int = Field(
        default=4096, ge=0, description="Processes and threads of each compile or check sandbox, all together "
        "(cgroup pids.max; Inductor's compile workers, g++ and every thread count); without cgroups RLIMIT_NPROC of "
        "the children's uid (per sandbox with AOTC_SANDBOX_BOUNDS=uid, else shared by every child of that uid on "
        "the host); 0: none."
    )
    child_max_open_files: int = Field(
        default=8192, ge=0, description="Open files per process (RLIMIT_NOFILE) in compile and check children; 0: none."
    )

    @field_validator("worker_targets", "build_only_targets")
    @classmethod
    def _known_targets(cls, value: list[str], info: ValidationInfo) -> list[str]:
        try:  # aliases become levels; whether this host can serve them is checked at start (compiler.device)
            return [str(Target.parse(t)) for t in value]
        except AotcError as e:
            raise ValueError(f"AOTC_{str(info.field_name).upper()}: {e.message}") from None

    @model_validator(mode="after")
    def _redis_password(self) -> WorkerSettings:
        self.redis_url = with_password_file(self.redis_url, self.redis_password_file)
        return self

    @model_validator(mode="after")
    def _lease_outlives_heartbeat(self) -> WorkerSettings:
        if self.lease_s <= 2 * self.heartbeat_s:
            raise ValueError(f"AOTC_LEASE_S ({self.lease_s}) must exceed twice AOTC_HEARTBEAT_S ({self.heartbeat_s})")
        return self
