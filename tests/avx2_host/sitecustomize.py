"""ISA caps of an emulated AVX2-only host, in every Python process started with $JAXPAR_EMULATE_AVX2=1
and this folder on PYTHONPATH (Python imports `sitecustomize` from sys.path at start-up); see
tests/avx2_host/__init__.py for the whole emulation and what each cap changes.

Two caps need code in the process, not only an environment variable:
  * XLA:CPU's LLVM codegen: `--xla_cpu_max_isa=AVX2`, re-added to XLA_FLAGS here because the
    tests' and parity runs' subprocesses rebuild XLA_FLAGS from scratch (device counts);
  * YNNPACK inside XLA (every fp32 / bf16 dot jaxpar runs): it picks its kernels from
    `ynn::get_supported_arch_flags()`, a function-local static filled once from cpuinfo (CPUID),
    with no environment variable or XLA flag over it (xla_cpu_max_isa caps LLVM codegen only;
    XNNPACK/ynnpack source, ynnpack/base/arch.cc). Right after jaxlib loads libjax_common.so and
    before anything compiles, this sets that static to its AVX2-and-older bits
    (sse2|ssse3|sse41|avx|f16c|avx2|fma3 = bits 0-6 in ynnpack/base/arch.h, the same in both
    layouts the header has had). The symbols come from the library's own ELF .symtab.
"""

import os
import sys

_YNN_FN = b"_ZN3ynn24get_supported_arch_flagsEv"
_YNN_STATIC = b"_ZZN3ynn24get_supported_arch_flagsEvE5flags"
YNN_AVX2_BITS = 0x7F  # arch_flag::sse2 .. fma3


def _symbols(lib: str, names: tuple[bytes, ...]) -> dict[bytes, int]:
    """{name: st_value} from an ELF64 little-endian file's .symtab (numpy: 740k symbols)."""
    import numpy as np

    with open(lib, "rb") as f:
        hdr = f.read(64)
        assert hdr[:5] == b"\x7fELF\x02", f"{lib}: not an ELF64 file"
        shoff, = np.frombuffer(hdr, "<u8", 1, 0x28)
        shentsize, shnum = np.frombuffer(hdr, "<u2", 2, 0x3A)
        f.seek(int(shoff))
        sh = np.frombuffer(f.read(int(shentsize) * int(shnum)), dtype=[
            ("name", "<u4"), ("type", "<u4"), ("flags", "<u8"), ("addr", "<u8"), ("offset", "<u8"),
            ("size", "<u8"), ("link", "<u4"), ("info", "<u4"), ("align", "<u8"), ("entsize", "<u8")])
        symtab = sh[sh["type"] == 2]  # SHT_SYMTAB
        assert len(symtab) == 1, f"{lib}: no .symtab (stripped?): cannot cap YNNPACK"
        strtab = sh[int(symtab["link"][0])]
        f.seek(int(symtab["offset"][0]))
        syms = np.frombuffer(f.read(int(symtab["size"][0])), dtype=[
            ("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")])
        f.seek(int(strtab["offset"]))
        strs = f.read(int(strtab["size"]))
    out = {}
    for name in names:  # every place the NUL-terminated name starts (the linker shares string tails)
        starts, i = [], strs.find(name + b"\0")
        while i >= 0:
            starts.append(i)
            i = strs.find(name + b"\0", i + 1)
        hit = syms[np.isin(syms["name"], starts) & (syms["value"] != 0)]
        assert len(hit) == 1, f"{lib}: {len(hit)} symbols named {name.decode()}: cannot cap YNNPACK"
        out[name] = int(hit["value"][0])
    return out


def cap_ynnpack() -> tuple[int, int]:
    """Set YNNPACK's detected ISA to its AVX2-and-older bits; returns (detected, now)."""
    import ctypes

    lib, base = next((ln.split()[-1], int(ln.split("-")[0], 16)) for ln in open("/proc/self/maps")
                     if ln.rstrip().endswith("/libjax_common.so") and ln.split()[2] == "00000000")
    # a shared library's first PT_LOAD maps file offset 0 at vaddr 0: symbol value + base
    sym = _symbols(lib, (_YNN_FN, _YNN_STATIC))
    detect = ctypes.CFUNCTYPE(ctypes.c_uint64)(base + sym[_YNN_FN])
    detected = detect()  # runs the static's initialiser once (cpuinfo), so the write below sticks
    ctypes.c_uint64.from_address(base + sym[_YNN_STATIC]).value = detected & YNN_AVX2_BITS
    now = detect()
    assert now == detected & YNN_AVX2_BITS, (hex(detected), hex(now))
    os.environ["JAXPAR_YNN_ARCH_FLAGS"] = f"{detected:#x}->{now:#x}"  # for the guard test to read
    return detected, now


class _CapAfterJaxlib:
    """A meta-path finder for `jaxlib._jax` (the extension that loads libjax_common.so): imports it
    the normal way, then caps YNNPACK before jax can compile anything."""

    def find_spec(self, name, path=None, target=None):
        if name != "jaxlib._jax":
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            cap_ynnpack()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("JAXPAR_EMULATE_AVX2") == "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_cpu_max_isa" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_cpu_max_isa=AVX2".strip()
    sys.meta_path.insert(0, _CapAfterJaxlib())
