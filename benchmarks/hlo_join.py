"""Join a profile's per-instruction times to the compiled HLO: what each kernel computes, how many
bytes it moves, and which line of jaxpar's source it came from.

A jax.profiler trace names every device kernel's HLO instruction (`args["hlo_op"]`, e.g.
`loop_multiply_fusion.22`; the kernel name itself is that name with '.' -> '_', or a library
kernel's own name such as cuBLAS's `nvjet_*`). The compiled module's text
(`jitted.lower(...).compile().as_text()`) holds, per instruction, its shape, its operands, its
fused computation and a `stack_frame_id` into the module's FileNames / FunctionNames /
FileLocations / StackFrames tables: the Python line that traced the op. So a kernel's time can be
charged to `gpt2.py:150 LayerNorm.__call__` or `optim.py:88 update.leaf` and its bandwidth compared
with the memory's peak.

    m = parse_module(compiled_text)
    rows = join({"loop_multiply_fusion.22": 2.24, ...}, m)   # ms per step by HLO name
    by_source(rows)                                           # ms per source line

Bytes are an upper bound on the traffic: every operand counted whole, the output once (a fusion
that reads a slice of an operand is charged the whole operand)."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
# "  ROOT %name = shape opcode(operands), attrs" (the '%' is optional in newer printers)
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # "f32[8,128]{1,0}" or a tuple "(f32[..], bf16[..])"
    opcode: str
    operands: list[str]
    computation: str  # the computation it sits in
    calls: str = ""  # a fusion's fused computation
    op_name: str = ""
    frame: int = 0


@dataclasses.dataclass
class Module:
    instrs: dict[str, Instr]
    computations: dict[str, list[str]]  # name -> its instructions, in order
    frames: dict[int, str]  # stack_frame_id -> "file.py:line function" of its innermost call
    by_kernel: dict[str, Instr]  # normalize(name) -> instruction: a kernel's spelling of its name


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a (possibly tuple) HLO shape string; an unknown dtype counts 0."""
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES.get(dtype, 0)
    return total


def _operands(args: str) -> list[str]:
    """Operand names of an instruction's argument text ("%a, %b), dimensions={0}, ..."): the names
    before the closing parenthesis of the operand list."""
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%?([A-Za-z_][\w.\-]*)(?=\s*(?:,|$))", args[:end].replace(" ", ""))


def _frames(lines: list[str]) -> dict[int, str]:
    """stack_frame_id -> "file.py:line function" from the module's four source tables."""
    tables, current = collections.defaultdict(dict), None
    for line in lines:
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = s
            continue
        m = TABLE_ROW.match(s) if current else None
        if m:
            tables[current][int(m.group(1))] = m.group(2)
        else:
            current = None
    files = {k: os.path.basename(v.strip('"')) for k, v in tables["FileNames"].items()}
    funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    locs = {}
    for k, v in tables["FileLocations"].items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        fn = funcs.get(int(f.get("function_name_id", 0)), "?").replace("<locals>.", "")
        locs[k] = f"{files.get(int(f.get('file_name_id', 0)), '?')}:{f.get('line', '?')} {fn}"
    out = {}
    for k, v in tables["StackFrames"].items():
        m = re.search(r"file_location_id=(\d+)", v)
        if m:
            out[k] = locs.get(int(m.group(1)), "?")
    return out


def parse_module(text: str) -> Module:
    """The instructions, computations and source frames of a compiled HLO module's text."""
    lines = text.splitlines()
    instrs: dict[str, Instr] = {}
    comps: dict[str, list[str]] = {}
    comp = ""
    for line in lines:
        m = INSTR.match(line)
        if m and comp:
            name, shape, opcode, rest = m.groups()
            calls = re.search(r"\bcalls=%?([\w.\-]+)", rest)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            frame = re.search(r"stack_frame_id=(\d+)", rest)
            instrs[name] = Instr(name, shape, opcode, _operands(rest), comp, calls.group(1) if calls else "",
                                 op_name.group(1) if op_name else "", int(frame.group(1)) if frame else 0)
            comps[comp].append(name)
            continue
        c = COMPUTATION.match(line)
        if c and not line.startswith(" "):
            comp = c.group(1)
            comps[comp] = []
        elif line.startswith("}"):
            comp = ""
    return Module(instrs, comps, _frames(lines), {normalize(n): i for n, i in instrs.items()})


def normalize(name: str) -> str:
    """The kernel-name spelling of an HLO instruction name ('.' and '-' as '_')."""
    return re.sub(r"[.\-]", "_", name)


def lookup(module: Module, key: str) -> Instr | None:
    """The instruction a trace key names: its HLO name, or the kernel spelling of it."""
    return module.instrs.get(key) or module.by_kernel.get(normalize(key))


def sources(module: Module, ins: Instr, top: int = 3) -> list[str]:
    """Source lines of an instruction: its own frame, or for a fusion the most common frames of the
    ops inside it (parameters and constants aside), most common first, else the fusion's own."""
    own = [module.frames[ins.frame]] if ins.frame in module.frames else []
    if not ins.calls:
        return own
    count = collections.Counter(module.frames[i.frame] for n in module.computations.get(ins.calls, [])
                                if (i := module.instrs[n]).frame in module.frames
                                and i.opcode not in ("parameter", "constant"))
    return [s for s, _ in count.most_common(top)] or own  # a fused copy's ops carry no frame


def fused_ops(module: Module, ins: Instr, top: int = 6) -> dict[str, int]:
    """Opcode counts inside a fusion (parameters, constants, bitcasts aside), most common first."""
    skip = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple")
    c = collections.Counter(module.instrs[n].opcode for n in module.computations.get(ins.calls, [])
                            if module.instrs[n].opcode not in skip)
    return dict(c.most_common(top))


def traffic(module: Module, ins: Instr) -> int:
    """Bytes read and written, upper bound: every operand whole plus the output."""
    return shape_bytes(ins.shape) + sum(shape_bytes(module.instrs[o].shape) for o in ins.operands if o in module.instrs)


def join(ms_by_key: dict[str, float], module: Module, hbm_tbps: float | None = None) -> list[dict]:
    """One row per trace key, slowest first: its time, the instruction (None where the module does
    not name it: a runtime event, another module's kernel), bytes, GB/s and, given the memory's
    peak, the share of it reached; the source lines and a fusion's opcodes."""
    rows = []
    for key, ms in sorted(ms_by_key.items(), key=lambda kv: -kv[1]):
        ins = lookup(module, key)
        row = {"key": key, "ms": ms, "hlo": ins.name if ins else None}
        if ins:
            b = traffic(module, ins)
            row.update(opcode=ins.opcode, shape=ins.shape.split("{")[0][:120], bytes=b,
                       gb_per_s=b / (ms * 1e-3) / 1e9 if ms > 0 else None, op_name=ins.op_name,
                       sources=sources(module, ins), ops=fused_ops(module, ins) if ins.calls else {})
            if hbm_tbps and row["gb_per_s"] is not None:
                row["hbm_share"] = row["gb_per_s"] / (hbm_tbps * 1e3)
        rows.append(row)
    return rows


def by_source(rows: list[dict]) -> dict[str, float]:
    """ms per source line (a row's first source; "unjoined" / "no source" otherwise), most first."""
    c = collections.Counter()
    for r in rows:
        key = "unjoined" if r["hlo"] is None else (r["sources"][0] if r["sources"] else "no source")
        c[key] += r["ms"]
    return dict(c.most_common())
