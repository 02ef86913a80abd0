"""Round 4: a rank that fails at start exits (item 5), Ctrl-C is exit 130 in every
command (item 14), launch's -1 mesh axis (item 19). In-process with the faults injected:
os._exit and the commands are patched, so nothing here starts a job or a training.
Reference: exit codes and lines written down by hand here."""

from __future__ import annotations

import os

import pytest

from jaxpar import cli


class _Exited(Exception):
    def __init__(self, code):
        self.code = code


@pytest.fixture
def rank(monkeypatch):
    """This process as rank 1 of a 2-process `jaxpar launch` job; os._exit recorded, not done."""
    monkeypatch.setenv("JAXPAR_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("JAXPAR_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXPAR_PROCESS_ID", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")

    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", exit_)


@pytest.mark.parametrize("raised,code", [(RuntimeError("CPU backend set-up: Too many open files"), 1),
                                         (SystemExit(2), 2)])
def test_a_rank_that_fails_at_start_exits_at_once(rank, monkeypatch, capsys, raised, code):
    """The failing rank printed its traceback, then JAX's exit-time shutdown barrier waited on its
    peer forever (and the peer and launcher on it): it now leaves with os._exit."""
    from jaxpar.run import commands

    def train(argv):
        raise raised

    monkeypatch.setattr(commands, "train", train)
    monkeypatch.setattr("sys.argv", ["jaxpar", "train"])  # the process's entry: main() reads sys.argv
    with pytest.raises(_Exited) as e:
        cli.main()
    assert e.value.code == code
    err = capsys.readouterr().err
    assert ("RuntimeError: CPU backend set-up: Too many open files" in err) == (code == 1)


def test_a_rank_refusing_its_input_exits_at_once_and_a_plain_process_returns(rank, monkeypatch, capsys):
    from jaxpar.config import ConfigError
    from jaxpar.run import commands

    def train(argv):
        raise ConfigError("bad")

    monkeypatch.setattr(commands, "train", train)
    monkeypatch.setattr("sys.argv", ["jaxpar", "train"])
    with pytest.raises(_Exited) as e:
        cli.main()
    assert (e.value.code, capsys.readouterr().err) == (2, "error: bad\n")
    assert cli.main(["train"]) == 2  # called from Python (in-process tests, a job's env or not): returns
    monkeypatch.delenv("JAXPAR_COORDINATOR")
    assert cli.main() == 2  # the process's entry, not a job: returns, sys.exit ends it


@pytest.mark.parametrize("mesh,per", [({"data": -1}, 0), ({"data": -1, "tensor": 4}, 2),
                                      ({"data": -1, "tensor": 3}, 3), ({"fsdp": 2, "tensor": -1}, 0)])
def test_a_wildcard_axis_under_two_processes_fills_them(monkeypatch, mesh, per):
    """Item 19: under `launch nprocs=2` a -1 axis was counted as one device, so every rank refused
    'mesh data=-1 (1 devices) cannot be split evenly over 2 processes'. Now each process gets
    lcm(fixed axes, 2) / 2 devices (0: the one CPU device it has anyway) and -1 fills the rest."""
    from jaxpar.config import MeshConfig
    from jaxpar.parallel.mesh import emulate_devices_for

    monkeypatch.setenv("XLA_FLAGS", "")
    env = {"JAXPAR_COORDINATOR": "127.0.0.1:1", "JAXPAR_NUM_PROCESSES": "2", "XLA_FLAGS": ""}
    assert emulate_devices_for(MeshConfig(**mesh), env) == per
    assert os.environ["XLA_FLAGS"] == (f"--xla_force_host_platform_device_count={per}" if per else "")


def test_a_sequence_parallel_run_resumes_onto_a_mesh_without_tensor(tmp_path, capsys):
    """Item 20: the README promises resume onto any mesh; an inherited tensor.sequence_parallel=true
    was refused on mesh.tensor=1, and the line did not say tensor.sequence_parallel=false."""
    from jaxpar import config as C
    from jaxpar.parallel.layout import build_layout
    from jaxpar.run.rundir import resolve_train

    run = tmp_path / "run"
    run.mkdir()
    saved = C.resolve(["model=gpt2-tiny", "mesh.tensor=2", "tensor.sequence_parallel=true", f"out={run}"])
    (run / "config.json").write_text(C.dumps(saved))
    cfg = resolve_train({"resume": "true", "out": str(run), "mesh.tensor": "1", "mesh.data": "2"}, None)
    assert (cfg.tensor.sequence_parallel, cfg.mesh.data, cfg.mesh.tensor) == (False, 2, 1)
    assert capsys.readouterr().err == ("tensor.sequence_parallel=false: the run used sequence parallelism, which "
                                       "this mesh cannot take (needs mesh.tensor > 1 (it splits T over the tensor "
                                       "axis)); resumed without it\n")
    build_layout(cfg, 2)  # the layout takes it
    kept = resolve_train({"resume": "true", "out": str(run), "mesh.data": "2"}, None)  # tensor=2 still: kept
    assert kept.tensor.sequence_parallel and capsys.readouterr().err == ""
    given = resolve_train({"resume": "true", "out": str(run), "mesh.tensor": "1",
                           "tensor.sequence_parallel": "true"}, None)
    assert given.tensor.sequence_parallel  # asked for anew: the layout's refusal stands


@pytest.mark.parametrize("cmd", ["eval", "sample", "bisect"])
def test_ctrl_c_in_a_read_only_command_is_130_at_once(monkeypatch, capfd, cmd):
    """Item 14: the KeyboardInterrupt was lost in a gc callback (eval ran on, exit 0) or unwound into
    teardown with XLA / torch threads alive (sample, bisect: segfault, exit 139). The signal is
    delivered here for real, inside the command."""
    import signal

    from jaxpar.run import bisection, commands

    def exit_(code):
        raise _Exited(code)

    def command(argv):
        os.kill(os.getpid(), signal.SIGINT)
        return 0  # reached only when the interrupt was lost

    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(bisection if cmd == "bisect" else commands,
                        {"eval": "evaluate", "sample": "sample", "bisect": "main"}[cmd], command)
    # Python's own handler, as in a terminal: a suite started in the background (`cmd &`) inherits
    # SIGINT ignored, and the signal would never arrive
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(_Exited) as e:
            cli.main([cmd])
    finally:
        signal.signal(signal.SIGINT, before)
    assert e.value.code == 130 and capfd.readouterr().err == "error: interrupted\n"


def test_an_interrupted_process_entry_leaves_without_teardown(monkeypatch):
    """`jaxpar` as a process (argv None) that returns 130 (a writer's KeyboardInterrupt) exits with
    os._exit(130): no interpreter teardown under live XLA threads."""
    from jaxpar.run import commands

    def exit_(code):
        raise _Exited(code)

    def convert(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(commands, "convert", convert)
    monkeypatch.setattr("sys.argv", ["jaxpar", "convert"])
    with pytest.raises(_Exited) as e:
        cli.main()
    assert e.value.code == 130
    assert cli.main(["convert"]) == 130  # called as a function: returns
