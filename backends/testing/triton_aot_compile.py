"""Ahead-of-time compile of a Triton kernel for sm_<capability> on any host,
and what its cubin needs of the GPU (shared memory, registers, stack),
read from the ELF file: test support for the compile tests."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

from backends.triton import interpreter
from backends.triton import launch_record
from backends.triton.launch_record import LaunchRecord

# Resource limits of one program (a CUDA thread block) by compute capability
# (major * 10 + minor): shared memory a block may opt into, registers.
SHARED_BYTES_LIMIT = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_BLOCK = 64 * 1024
# Registers are allocated per warp in units of 256, i.e. per thread in
# multiples of 8.
REGISTER_ALLOCATION_UNIT = 8
# jax-triton tells Triton every array is 16-byte aligned; the AOT compile
# assumes the same, so that it vectorises loads as the launched kernel does.
POINTER_ALIGNMENT = 16

# Triton's pointer element types by numpy/ml_dtypes dtype name.
_TRITON_TYPES = {
    "bool": "i1",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}


def triton_type(dtype) -> str:
  """Triton's element type name of a dtype ("bf16", "fp32", "i32", ...)."""
  name = np.dtype(dtype).name
  if name not in _TRITON_TYPES:
    raise ValueError(
        f"No Triton pointer type for {name}; known: {sorted(_TRITON_TYPES)}."
    )
  return _TRITON_TYPES[name]


@dataclasses.dataclass(frozen=True)
class CompiledInfo:
  """What one compiled kernel needs of the GPU.

  Attributes:
    name: the kernel's name.
    capability: the target, e.g. 90 for sm_90.
    num_warps, num_stages: the launch options compiled with.
    shared_bytes: dynamic shared memory one program requests (Triton's
      metadata: what the launch asks the driver for).
    registers: registers per thread (the cubin's EIATTR_REGCOUNT).
    local_bytes: per-thread stack frame (spills), from EIATTR_FRAME_SIZE.
  """

  name: str
  capability: int
  num_warps: int
  num_stages: int
  shared_bytes: int
  registers: int
  local_bytes: int

  @property
  def threads(self) -> int:
    return 32 * self.num_warps

  def violations(self) -> list[str]:
    """The GPU limits this kernel breaks; empty if it fits."""
    if self.capability not in SHARED_BYTES_LIMIT:
      raise ValueError(
          f"No limits known for capability {self.capability}; known: "
          f"{sorted(SHARED_BYTES_LIMIT)}."
      )
    found = []
    shared_limit = SHARED_BYTES_LIMIT[self.capability]
    if self.shared_bytes > shared_limit:
      found.append(f"shared memory {self.shared_bytes} > {shared_limit} bytes")
    if self.registers > MAX_REGISTERS_PER_THREAD:
      found.append(
          f"{self.registers} registers per thread > {MAX_REGISTERS_PER_THREAD}"
      )
    unit = REGISTER_ALLOCATION_UNIT
    per_block = -(-self.registers // unit) * unit * self.threads
    if per_block > REGISTERS_PER_BLOCK:
      found.append(
          f"{per_block} registers per block ({self.registers} x "
          f"{self.threads} threads) > {REGISTERS_PER_BLOCK}"
      )
    return found


def compile_kernel(
    kernel,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    capability: int,
    num_warps: int,
    num_stages: int,
) -> CompiledInfo:
  """triton.compile for sm_<capability>, on any host (no GPU needed).

  Args:
    kernel: a @triton.jit kernel.
    signature: {parameter: "*bf16" | "*fp32" | ... | "constexpr"} for every
      parameter.
    constexprs: the constexpr values by name.
    capability: 90 (Hopper), 100 (Blackwell), ...
    num_warps, num_stages: Triton's options.

  Returns:
    The kernel's CompiledInfo.
  """
  # pylint: disable=g-import-not-at-top
  import triton
  from triton.backends import compiler as triton_backends
  # pylint: enable=g-import-not-at-top

  names = [p for p, _, _ in launch_record.parameters(kernel)]
  # Pointers get the alignment jax-triton promises (attrs keyed by index).
  attrs = {
      (names.index(p),): [["tt.divisibility", POINTER_ALIGNMENT]]
      for p, kind in signature.items()
      if kind.startswith("*")
  }
  source = triton.compiler.ASTSource(
      fn=kernel,
      signature=dict(signature),
      constexprs=dict(constexprs),
      attrs=attrs,
  )
  # Not while an interpreted launch (a host callback, maybe still running
  # on another thread) has triton.language patched: the code generator
  # would meet the interpreter's functions ("'value' object has no
  # attribute 'dtype'").
  with interpreter.LOCK:
    compiled = triton.compile(
        source,
        target=triton_backends.GPUTarget("cuda", capability, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
  name = compiled.metadata.name
  registers, frame = cubin_resources(compiled.asm["cubin"], name)
  return CompiledInfo(
      name=name,
      capability=capability,
      num_warps=num_warps,
      num_stages=num_stages,
      shared_bytes=int(compiled.metadata.shared),
      registers=registers,
      local_bytes=frame,
  )


def compile_for(record: LaunchRecord, capability: int) -> CompiledInfo:
  """Compiles a recorded launch (its dtypes, constexprs and options)."""
  types = iter(record.in_avals + record.out_types)
  signature = {}
  for p, is_constexpr, _ in launch_record.parameters(record.kernel):
    signature[p] = (
        "constexpr" if is_constexpr else "*" + triton_type(next(types).dtype)
    )
  return compile_kernel(
      record.kernel,
      signature,
      record.constexprs,
      capability,
      record.num_warps,
      record.num_stages,
  )


# EIATTR attributes of a cubin's .nv.info section (CUDA's ELF notes): each
# record is a format byte, an attribute byte, then per format: nothing, one
# byte or a 16-bit value (all padded to 4 bytes), or (format 4) a 16-bit
# size and that many bytes. REGCOUNT and FRAME_SIZE hold (symbol index,
# value), two 32-bit words.
_EIFMT_SVAL = 0x04
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F


def _elf_sections(cubin: bytes) -> list[tuple[str, tuple]]:
  """(name, header) of each section of a 64-bit little-endian ELF file.

  header: (name, type, flags, addr, offset, size, link, info, align,
  entsize), as Elf64_Shdr.
  """
  if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
    raise ValueError("Not a 64-bit little-endian ELF file (a cubin).")
  (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
  entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
  headers = [
      struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize)
      for i in range(count)
  ]
  names_offset = headers[names_index][4]

  def string(offset, base=names_offset):
    end = cubin.index(b"\0", base + offset)
    return cubin[base + offset : end].decode()

  return [(string(h[0]), h) for h in headers]


def cubin_resources(cubin: bytes, kernel: str) -> tuple[int, int]:
  """(registers per thread, stack frame bytes) of `kernel` in a cubin.

  Read from the ELF file itself (the .nv.info attributes that cuobjdump
  --dump-resource-usage prints), so no CUDA tool or GPU is needed.
  """
  sections = _elf_sections(cubin)
  by_name = dict(sections)
  symtab = by_name[".symtab"]
  strtab = sections[symtab[6]][1]
  symbol = None
  for i in range(symtab[5] // 24):
    (name_offset,) = struct.unpack_from("<I", cubin, symtab[4] + 24 * i)
    end = cubin.index(b"\0", strtab[4] + name_offset)
    if cubin[strtab[4] + name_offset : end].decode() == kernel:
      symbol = i
      break
  if symbol is None:
    raise ValueError(f"No symbol {kernel!r} in the cubin.")
  info = by_name[".nv.info"]
  data = cubin[info[4] : info[4] + info[5]]
  values = {}
  at = 0
  while at + 4 <= len(data):
    fmt, attr = data[at], data[at + 1]
    if fmt != _EIFMT_SVAL:
      at += 4
      continue
    (size,) = struct.unpack_from("<H", data, at + 2)
    if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
      owner, value = struct.unpack_from("<II", data, at + 4)
      if owner == symbol:
        values[attr] = value
    at += 4 + size
  if _EIATTR_REGCOUNT not in values:
    raise ValueError(f"The cubin has no register count for {kernel!r}.")
  return values[_EIATTR_REGCOUNT], values.get(_EIATTR_FRAME_SIZE, 0)
