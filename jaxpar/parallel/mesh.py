"""Mesh utilities (public API): build, validate and describe the `(data, fsdp, tensor, pipe)`
mesh, emulate CPU devices, and join a multi-process job.

    from jaxpar.config import MeshConfig
    from jaxpar.parallel import mesh as M
    m = M.build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))      # exactly 8 devices, or ConfigError
    print(M.describe(m))                                        # device grid with process ids
    sh = M.logical_sharding(m, ("batch", "seq", "embed"), rules) # NamedSharding from logical names
    with M.mesh_and_rules(m, S.model_rules(MeshConfig(**m.shape))):  # any Flax model: jax.set_mesh +
        model = MyModel(rngs=nnx.Rngs(0))                       # Flax's logical_axis_rules (examples/08)

Design decisions (why, not what):

* Canonical axis order `(data, fsdp, tensor, pipe)` names the mesh dims; the devices are placed
  in `PLACEMENT` order `(pipe, data, fsdp, tensor)`, outermost = slowest links. With devices
  ordered by process (as `jax.devices()` is), a tensor group is consecutive devices (one host:
  its all-reduces run per layer), then fsdp, then data, and pipeline stages are strided by
  n/pipe, Megatron-LM's rank layout (`megatron/core/parallel_state.py`: pipeline traffic is one
  activation per microbatch). Placing by the name order instead would put `pipe` innermost, so
  tensor=8 x pipe=8 would spread every tensor group over 8 hosts.
* The product must equal the device count. `jax.make_mesh` silently takes the first N
  devices when the product is smaller; we refuse, so `mesh.data=2` on an 8-GPU host is an
  error rather than 6 idle GPUs. Library callers who *want* a subset pass `devices=`
  explicitly (tests do: `build_mesh(mc, jax.devices()[:4])`).
* Axis types are `AxisType.Auto` on every axis. This JAX's `jax.make_mesh` defaults to
  `Explicit`, which makes shardings part of array types and requires `out_sharding=` on
  every op whose result sharding is ambiguous (e.g. contractions over a sharded dim). Our
  model is parallelism-free and states shardings only through the rules tables (jit in/out
  shardings + `with_sharding_constraint` on logical names), so the compiler's propagation
  (Auto) is the right contract.
* CPU device emulation (`--xla_force_host_platform_device_count`) must be set before JAX
  initialises its backends; the CLI calls `emulate_devices_for(mesh_cfg)` before importing
  anything that touches devices. Under a multi-process launch each process emulates its
  share (mesh size / process count).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys

from jaxpar.config import ConfigError, MeshConfig
from jaxpar.parallel.layout import resolve_mesh_config, shown_sizes  # noqa: F401  (resolve_mesh_config: public API)

AXES = ("data", "fsdp", "tensor", "pipe")  # canonical order of the mesh dims (names, specs, configs)
PLACEMENT = ("pipe", "data", "fsdp", "tensor")  # device placement, outermost (slowest links) first


# ----------------------------------------------------------------------------- sizes


# resolve_mesh_config (fill the -1, product == device count) is the layout's first rule; it is
# re-exported here as part of the mesh API.


def mesh_size(mc: MeshConfig) -> int:
    """Devices the mesh needs (-1 counted as 1)."""
    return math.prod(max(v, 1) for v in dataclasses.asdict(mc).values())


def mesh_shape(mesh) -> dict[str, int]:
    """{'data': 2, 'fsdp': 2, 'tensor': 2, 'pipe': 1} for a built mesh."""
    return dict(mesh.shape)


# ----------------------------------------------------------------------------- CPU emulation


MAX_EMULATED = 4096  # CPU devices one process emulates; a GPU node has at most a few dozen devices


_COUNT_FLAG = "--xla_force_host_platform_device_count"
_SET_HERE: set[str] = set()  # the count flags this process wrote (emulate_host_devices): not the user's


def emulate_host_devices(n: int) -> None:
    """Ask XLA for `n` CPU devices. Must run before JAX initialises its backends (no effect
    afterwards). GPU/TPU backends ignore this flag."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if not f.startswith(_COUNT_FLAG))
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()
    _SET_HERE.add(f"{_COUNT_FLAG}={n}")


def _users_count(env) -> str | None:
    """The device count the user's own XLA_FLAGS asks for (the last count flag), None when there is
    none or this process wrote it (a CLI called twice in one process)."""
    given = [f for f in env.get("XLA_FLAGS", "").split() if f.startswith(f"{_COUNT_FLAG}=")]
    return None if not given or given[-1] in _SET_HERE else given[-1].partition("=")[2]


def emulate_devices_for(mc: MeshConfig, env=None) -> int:
    """Emulate as many CPU devices per process as `mc` needs (mesh size / process count; with a
    -1 axis, lcm(fixed axes, processes) / processes, so that the wildcard fills whole processes).

    Keeps a user's own `--xla_force_host_platform_device_count` when the mesh has a -1 axis
    (the wildcard then fills whatever was asked for); replaces one that disagrees with the mesh, with a
    one-line `warning:` on stderr (the run goes on: the mesh's sizes are what the user gave last, and
    an error would stop runs whose environment keeps an old count). Returns the per-process count set
    (0: none).
    """
    env = os.environ if env is None else env
    nprocs = cluster_size(env)
    n = mesh_size(mc)
    has_wild = any(v == -1 for v in dataclasses.asdict(mc).values())
    if has_wild and "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
        return 0
    if has_wild:  # the -1 axis fills the devices: the fewest that both the fixed axes (n) and the
        per = n // math.gcd(n, nprocs)  # processes divide, lcm(n, nprocs); one process: n, as before
    elif n % nprocs:
        raise ConfigError(f"mesh {shown_sizes(dataclasses.asdict(mc))} ({n} devices) cannot be split evenly over "
                          f"{nprocs} processes")
    else:
        per = n // nprocs
    if per > MAX_EMULATED:  # XLA aborts on a count past 2^31 - 1, and hangs creating a million
        raise ConfigError(f"mesh {shown_sizes(dataclasses.asdict(mc))} needs {per} devices per process; at most "
                          f"{MAX_EMULATED} CPU devices can be emulated in one process")
    if (asked := _users_count(env)) is not None and asked != str(per):
        # the mesh decides the count (build_mesh refuses idle devices): say so, one line, and go on
        sys.stderr.write(f"warning: XLA_FLAGS {_COUNT_FLAG}={asked} replaced by {per}, the devices per process of "
                         f"mesh {shown_sizes(dataclasses.asdict(mc))}; a -1 axis (mesh.data=-1) fills the devices "
                         "asked for\n")
    if per > 1 or "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
        emulate_host_devices(per)
        return per
    return 0


# ----------------------------------------------------------------------------- build / describe


def build_mesh(spec, devices=None):
    """A `jax.sharding.Mesh` with axes (data, fsdp, tensor, pipe) and Auto axis types.

    spec: a run's `ParallelLayout` (its sizes are already resolved: used as they are), or a
    `MeshConfig` (one -1 is filled here, for library use). `devices`: defaults to every device of
    every process (`jax.devices()`). The product of the sizes must equal `len(devices)`, else
    ConfigError.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType

    devices = jax.devices() if devices is None else list(devices)
    if isinstance(spec, MeshConfig):
        mc = resolve_mesh_config(spec, len(devices))
    else:  # a ParallelLayout: resolved once, in build_layout
        mc = spec.mesh
        if mesh_size(mc) != len(devices):
            raise ConfigError(f"mesh {shown_sizes(dataclasses.asdict(mc))} was resolved for {mesh_size(mc)} "
                              f"devices but {len(devices)} were given")
    # fill the devices in PLACEMENT order (tensor fastest), then name the dims in AXES order
    placed = np.asarray(devices, dtype=object).reshape([getattr(mc, a) for a in PLACEMENT])
    grid = placed.transpose([PLACEMENT.index(a) for a in AXES])
    return jax.sharding.Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe(mesh) -> str:
    """Human-readable mesh: sizes, axis types, devices and processes, and the device grid.

    The grid has one row per (data, fsdp) coordinate and one column per (tensor, pipe)
    coordinate; each cell is `<device id>@p<process index>`.
    """
    import jax
    import numpy as np

    shape = dict(mesh.shape)
    devs = mesh.devices  # ndarray shaped like the mesh, axes in AXES order
    n = devs.size
    procs = sorted({d.process_index for d in devs.flat})
    kinds = sorted({f"{d.platform}:{d.device_kind}" for d in devs.flat})
    types = sorted({str(t).split(".")[-1] for t in getattr(mesh, "axis_types", ())}) or ["?"]
    lines = [
        f"mesh: {shown_sizes(shape)} = {n} devices, axis types {'/'.join(types)}",
        f"devices: {jax.device_count()} global ({jax.local_device_count()} local, {', '.join(kinds)}); "
        f"processes: {jax.process_count()} (this is process {jax.process_index()}); mesh spans {len(procs)}",
    ]
    rows_axes = [a for a in mesh.axis_names if a in ("data", "fsdp")]
    cols_axes = [a for a in mesh.axis_names if a not in rows_axes]
    grid = np.asarray(devs).reshape(math.prod(shape[a] for a in rows_axes), math.prod(shape[a] for a in cols_axes))
    cells = [[f"{d.id}@p{d.process_index}" for d in row] for row in grid]
    w = max(len(c) for row in cells for c in row)
    lines.append(f"grid: rows ({','.join(rows_axes)}) × columns ({','.join(cols_axes)}); cell = device@process")
    for idx, row in zip(np.ndindex(*[shape[a] for a in rows_axes]), cells):
        label = ",".join(f"{a}={i}" for a, i in zip(rows_axes, idx))
        lines.append(f"  [{label}]  " + " ".join(c.rjust(w) for c in row))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- logical shardings


def logical_sharding(mesh, names, rules):
    """NamedSharding for a tensor whose dims carry logical `names` (None = unsharded)."""
    from jax.sharding import NamedSharding

    from jaxpar.parallel.logical import spec_for

    return NamedSharding(mesh, spec_for(names, rules))


def logical_shardings(mesh, axes_tree, rules):
    """Tree of logical-axes tuples (e.g. `gpt2.param_axes()`) -> tree of NamedSharding."""
    import jax

    return jax.tree.map(lambda a: logical_sharding(mesh, a, rules), axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def shard_tree(tree, mesh, axes_tree, rules):
    """Place a (numpy or jax) tree on `mesh` by logical axes: `device_put` with the resolved shardings."""
    import jax

    return jax.device_put(tree, logical_shardings(mesh, axes_tree, rules))


# ----------------------------------------------------------------------------- multi-process

# Environment a launcher sets (jaxpar launch sets the JAXPAR_* ones).
ENV_COORDINATOR = "JAXPAR_COORDINATOR"  # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXPAR_LOCAL_DEVICE_IDS"  # comma-separated, optional
ENV_INIT_TIMEOUT = "JAXPAR_INIT_TIMEOUT"  # seconds to wait for all processes to join (default 120)
ENV_HEARTBEAT_TIMEOUT = "JAXPAR_HEARTBEAT_TIMEOUT"  # seconds before a silent peer is declared dead (default 30)


def detect_cluster(env=None) -> dict | None:
    """Which launcher started us, from the environment; None for a plain single process.

    Returns {"method", "num_processes", "process_id"} where method is one of
    `jaxpar` (jaxpar launch / explicit JAXPAR_* variables), `slurm` (srun), `ompi`
    (Open MPI's mpirun), `mpi4py` (any other MPI, e.g. the mpich wheel's mpiexec, via PMI_*).
    """
    env = os.environ if env is None else env

    def _int(k):
        try:
            return int(env[k])
        except (KeyError, ValueError):
            return None

    if env.get(ENV_COORDINATOR) and _int(ENV_NUM_PROCESSES):
        return {"method": "jaxpar", "num_processes": _int(ENV_NUM_PROCESSES), "process_id": _int(ENV_PROCESS_ID)}
    if (_int("SLURM_NTASKS") or 1) > 1 and env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_NODELIST"):
        return {"method": "slurm", "num_processes": _int("SLURM_NTASKS"), "process_id": _int("SLURM_PROCID")}
    if (_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return {"method": "ompi", "num_processes": _int("OMPI_COMM_WORLD_SIZE"),
                "process_id": _int("OMPI_COMM_WORLD_RANK")}
    if (_int("PMI_SIZE") or 1) > 1:  # MPICH / Hydra (and Intel MPI)
        return {"method": "mpi4py", "num_processes": _int("PMI_SIZE"), "process_id": _int("PMI_RANK")}
    return None


def cluster_size(env=None) -> int:
    """Number of processes the launcher started (1 when not launched)."""
    c = detect_cluster(env)
    return c["num_processes"] if c else 1


def _use_cpu_collectives() -> None:
    """Cross-process collectives on the CPU backend go through gloo (the default, none, fails)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids=None, method: str = "auto",
                           timeout_s: int | None = None, heartbeat_timeout_s: int | None = None) -> dict:
    """Join a multi-process JAX job (wraps `jax.distributed.initialize`).

    method: `auto` (detect from the environment, see `detect_cluster`), `jaxpar`, `slurm`,
    `ompi`, `mpi4py`, or `explicit` (use the arguments only). Explicit arguments override
    what is detected. `timeout_s` bounds the wait for every process to join; `heartbeat_timeout_s`
    bounds how long the survivors wait on a process that died (they then exit with an error).
    Returns the settings used.
    """
    import jax

    env = os.environ
    det = detect_cluster(env) if method == "auto" else {"method": method}
    if det is None:
        det = {"method": "explicit"}
    m = det["method"]
    kw: dict = {}
    if m == "jaxpar":
        kw = {"coordinator_address": env[ENV_COORDINATOR], "num_processes": int(env[ENV_NUM_PROCESSES]),
              "process_id": int(env[ENV_PROCESS_ID])}
        if env.get(ENV_LOCAL_DEVICES):
            kw["local_device_ids"] = [int(x) for x in env[ENV_LOCAL_DEVICES].split(",")]
    elif m == "mpi4py":
        kw = {"cluster_detection_method": "mpi4py"}
    # slurm / ompi: jax's own cluster detection reads SLURM_* / OMPI_* itself.
    for k, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                 ("process_id", process_id), ("local_device_ids", local_device_ids)):
        if v is not None:
            kw[k] = v
    if kw.get("coordinator_address"):
        kw.pop("cluster_detection_method", None)
        # JAX's coordination service binds every interface ([::]) unless told otherwise: any host
        # that reaches this one could join the job. It binds the address it is given (127.0.0.1
        # under `jaxpar launch`); JAX_COORDINATOR_BIND_ADDRESS, JAX's own setting, still wins.
        if "JAX_COORDINATOR_BIND_ADDRESS" not in env:
            kw["coordinator_bind_address"] = kw["coordinator_address"]
    kw["initialization_timeout"] = int(timeout_s if timeout_s is not None else env.get(ENV_INIT_TIMEOUT, 120))
    kw["heartbeat_timeout_seconds"] = int(heartbeat_timeout_s if heartbeat_timeout_s is not None
                                          else env.get(ENV_HEARTBEAT_TIMEOUT, 30))
    _use_cpu_collectives()
    jax.distributed.initialize(**kw)
    _no_persistent_cache_across_cpu_processes()
    return {"method": m, **{k: v for k, v in kw.items()}}


def _no_persistent_cache_across_cpu_processes() -> None:
    """Turn JAX's persistent compilation cache off in a multi-process CPU job, with one line from
    process 0. On jax 0.12.1 every process of such a job hangs for good in the first step whose
    executable it read from the cache (a cross-process psum of 2 processes, run twice: the second
    run never returns; jax 0.10.2 runs it). CPU programs compile in seconds, so nothing is lost."""
    import jax

    if not jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        return
    if jax.process_count() < 2 or jax.default_backend() != "cpu":
        return
    jax.config.update("jax_enable_compilation_cache", False)
    if jax.process_index() == 0:
        print(f"note: the compilation cache ({jax.config.jax_compilation_cache_dir}) is off in a multi-process "
              "CPU job (jax 0.12.1 hangs running a program read from it)", file=sys.stderr)


def maybe_initialize_distributed() -> dict | None:
    """Initialise when a launcher (jaxpar launch, mpiexec, srun) started several processes;
    a no-op for a plain single process. Called by the CLI before JAX touches devices."""
    import jax

    det = detect_cluster()
    if det is None:
        return None
    if jax.distributed.is_initialized():
        return None
    _library_stdout_to_devnull()
    if det["method"] == "jaxpar":
        _wait_for_coordinator(os.environ)
    try:
        return initialize_distributed()
    except Exception as e:  # e.g. a peer never started: a bounded, one-line failure
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: could not join the multi-process job ({msg})", file=sys.stderr)
        raise SystemExit(3) from None


def _wait_for_coordinator(env) -> None:
    """A process other than 0 waits (up to the join timeout) for process 0's coordinator to accept
    connections. When nothing ever does (a JAXPAR_COORDINATOR left in the shell by another job),
    JAX aborts with a C++ stack after its deadline; this is one line and exit 3 instead."""
    import socket
    import time

    if env.get(ENV_PROCESS_ID, "0").strip() == "0":
        return  # process 0 starts the coordinator itself
    address = env[ENV_COORDINATOR]
    host, _, port = address.rpartition(":")
    timeout = float(env.get(ENV_INIT_TIMEOUT, 120))
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                print(f"error: could not join the multi-process job (nothing accepts connections at "
                      f"{ENV_COORDINATOR}={address} after {timeout:g} s; is it left over from another job?)",
                      file=sys.stderr)
                raise SystemExit(3) from None
            time.sleep(0.2)


def _library_stdout_to_devnull() -> None:
    """Gloo (JAX's CPU collectives) prints "[Gloo] Rank 0 is connected to 1 peer ranks. Expected
    ..." with C++ std::cout on fd 1 from every process at once, pieces interleaved into the
    command's stdout (eval's JSON line, sample's text). The CLI prints through sys.stdout, so
    fd 1 goes to /dev/null (not stderr: a lost peer's failure is one stderr line) and sys.stdout
    keeps the original stdout."""
    sys.stdout.flush()
    out = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    stream = os.fdopen(out, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)
    if hasattr(sys.stdout, "retarget"):  # the CLI's closed-pipe guard (jaxpar.cli) keeps guarding
        sys.stdout.retarget(stream)
    else:
        sys.stdout = stream


def setup_devices(mc: MeshConfig) -> None:
    """Before JAX initialises: on CPU, emulate the host devices the mesh needs (mesh size /
    process count per process; GPUs ignore the flag), then join a multi-process job when
    launched by `jaxpar launch`, mpiexec or SLURM. Every command that runs a model calls this."""
    emulate_devices_for(mc)
    maybe_initialize_distributed()


def barrier(name: str, timeout_s: float = 600.0) -> None:
    """Wait (up to `timeout_s`) until every process reaches `name`; no-op single-process.

    Uses the coordination service, not a device collective: gloo gives a peer only 30 s to
    join a collective's first use, so processes whose compile times differ (a loaded host)
    line up here first, with a generous, explicit bound."""
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return
    client.wait_at_barrier(name, int(timeout_s * 1000))


# ----------------------------------------------------------------------------- mesh + rules context


@contextlib.contextmanager
def mesh_and_rules(mesh, rules):
    """Enter `mesh` and a logical-axis rules table together, for any Flax model:

        with M.mesh_and_rules(mesh, S.model_rules(mesh_cfg)):
            model = MyModel(rngs=nnx.Rngs(0))   # nnx.with_partitioning params land sharded

    Inside: `jax.set_mesh(mesh)` (jit and Flax's eager sharding see the mesh), Flax's
    `logical_axis_rules(pairs)` (nnx.with_partitioning names, `nnx.get_partition_spec`,
    `flax.linen.with_logical_constraint` resolve by them), and jaxpar's own activation rules
    (`jaxpar.parallel.logical.constrain`). `rules`: a dict (as `sharding.param_rules` returns) or Flax pairs.
    Yields the pairs."""
    import jax
    from flax import linen

    from jaxpar.parallel.logical import activation_rules
    from jaxpar.parallel.sharding import to_flax_rules

    pairs = to_flax_rules(rules)
    with jax.set_mesh(mesh), linen.logical_axis_rules(pairs), activation_rules(mesh, dict(pairs)):
        yield pairs
