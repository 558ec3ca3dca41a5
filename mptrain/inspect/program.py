"""A compiled XLA program read from its text (`compiled.as_text()`), for any accelerator.

XLA compiles for a GPU or a TPU that is not attached (`mptrain.target`), but a GPU program
compiled that way has no `cost_analysis()`: what it computes is read here instead. `Program`
parses the module into its computations and instructions and answers, each instruction
weighed by how often it runs (a `while` body by its known trip count):

- `attention()`: cuDNN's fused attention calls, and the `[.., L, L]` buffers of a materialised
  one; `largest()`: the biggest buffers the kernels write;
- `kernels()`: the instructions that launch work (fusions, custom calls, unfused ops), a lower
  bound on the kernels a GPU runs (a library call may be several);
- `where(instruction)`: the `file:line` of the user code that made it, from the module's stack
  frame tables (the first frame outside installed libraries), else JAX's `op_name`.

Types print as `bf16[16,1024]{1,0}` or tuples of them; operands as `%name`. A bottom module: it
imports nothing from mptrain.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator

# an array type and its layout, whose `S(n)` names a memory space other than HBM (a TPU's
# on-chip VMEM is S(1)): `f32[256,768]{1,0:T(8,128)S(1)}`
ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$")
_CALLEE = r"(?:calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)"
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while"}
_NOT_KERNELS |= {"conditional", "call", "after-all", "add-dependency", "opt-barrier", "domain"}
_NOT_KERNELS |= {"partition-id", "replica-id", "copy-start", "copy-done", "get-dimension-size"}
_NOT_KERNELS |= {"slice-start"}  # a TPU's copy of a slice into on-chip memory: a DMA
_LIBRARIES = ("site-packages", "dist-packages")
ATTENTION = "__cudnn$fmha"  # cuDNN's fused attention: forward and backward targets start so
NUMPY_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}
NUMPY_NAMES |= {"f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "pred": "bool"}


def dtype_name(hlo_dtype: str) -> str:
    """numpy's name of an HLO element type (`bf16` -> `bfloat16`; `s32` -> `int32`)."""
    if hlo_dtype in NUMPY_NAMES:
        return NUMPY_NAMES[hlo_dtype]
    kind = {"s": "int", "u": "uint", "f": "float", "c": "complex"}.get(hlo_dtype[0])
    return f"{kind}{hlo_dtype[1:]}" if kind and hlo_dtype[1:].isdigit() else hlo_dtype


def placed(type_text: str) -> list[tuple[str, tuple[int, ...], bool]]:
    """`(dtype, dims, in device memory)` of every array written in a type, in order, e.g.
    `(f32[8]{0}, bf16[2,3]{1,0:S(1)})`: a TPU's other memory spaces (`S(n)`) are on chip."""
    return [
        (dtype, tuple(int(n) for n in dims.split(",") if n), not re.search(r"S\([1-9]", layout))
        for dtype, dims, layout in ARRAY.findall(type_text)
    ]


def arrays(type_text: str, hbm: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """`(dtype, dims)` of every array written in a type; with `hbm`, only those in device
    memory (see `placed`)."""
    return [(dtype, dims) for dtype, dims, in_hbm in placed(type_text) if in_hbm or not hbm]


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    """Bytes of an array of HLO element type `dtype` (`pred` takes a byte, `s4` half of one)."""
    bits = re.search(r"\d+", dtype)
    bits = 8 if dtype == "pred" else int(bits.group()) if bits else 0  # token: nothing
    return math.prod(dims) * bits // 8


def type_bytes(type_text: str, hbm: bool = False) -> int:
    """Bytes of every array a type holds (a tuple's elements summed); `hbm`: see `arrays`."""
    return sum(nbytes(dtype, dims) for dtype, dims in arrays(type_text, hbm))


def top_level(type_text: str) -> list[str]:
    """The elements of a tuple type, each as text (an array type gives itself)."""
    text = type_text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, char in enumerate(text):
        depth += 1 if char in "({[" else -1 if char in ")}]" else 0
        if (char == "," and depth == 1) or depth == 0:
            parts.append(re.sub(r"/\*.*?\*/", "", text[start:i]).strip())
            start = i + 1
    return [p for p in parts if p]


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # the result type's text
    opcode: str
    operands: tuple[str, ...]  # operand names
    attributes: str  # everything after the operands
    index: int | None = None  # a parameter's number: `parameter(2)`

    def attribute(self, key: str) -> str | None:
        """The value of `key=value` among the attributes (braces kept), or None."""
        found = re.search(
            rf"\b{re.escape(key)}=(\{{[^}}]*\}}|\"[^\"]*\"|[^,\s{{}}]+)", self.attributes
        )
        return found.group(1).strip('"') if found else None

    def backend_config(self) -> dict:
        found = re.search(r"backend_config=(\{.*\})\s*$", self.attributes)
        try:
            return json.loads(found.group(1)) if found else {}
        except json.JSONDecodeError:
            return {}

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        return arrays(self.type)

    @property
    def nbytes(self) -> int:
        return type_bytes(self.type)


def _parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    type_text, rest = rest[:end], rest[end:].lstrip()
    opcode = re.match(r"[\w\-]+", rest)
    if not opcode or len(rest) <= opcode.end() or rest[opcode.end()] != "(":
        return None
    close = _balanced(rest, opcode.end())
    inside = rest[opcode.end() : close]
    operands = tuple(re.findall(r"%([\w.\-]+)", inside))
    number = re.fullmatch(r"\((\d+)\)", inside) if opcode.group() == "parameter" else None
    index = int(number.group(1)) if number else None
    return Instruction(name, type_text, opcode.group(), operands, rest[close:].lstrip(", "), index)


class Program:
    """A compiled module's text, parsed; see the module doc."""

    def __init__(self, text: str):
        self.text = text
        self.computations: dict[str, list[Instruction]] = {}
        self.types: dict[str, str] = {}  # instruction name -> its type (names are module-wide)
        self.home: dict[str, str] = {}  # instruction name -> its computation's
        self.callers: dict[str, Instruction] = {}  # computation -> an instruction calling it
        self.roots: dict[str, str] = {}  # computation -> its ROOT instruction's name
        self.entry, current = "", None
        for line in _instruction_lines(text):
            if current is None:
                header = _COMPUTATION.match(line)
                if header:
                    computation = header.group(2)
                    current = self.computations.setdefault(computation, [])
                    self.entry = header.group(2) if header.group(1) else self.entry
                continue
            if line.rstrip() == "}":
                current = None
            elif inst := _parse_instruction(line):
                current.append(inst)
                self.types[inst.name], self.home[inst.name] = inst.type, computation
                if line.lstrip().startswith("ROOT"):
                    self.roots[computation] = inst.name
        self.times, self.fused = self._weigh()
        self._frames = _frames(text)

    def _weigh(self) -> tuple[dict[str, float], set[str]]:
        """How often each computation runs per call of the entry, and which are fusion bodies
        (their instructions run inside one kernel) or scalar functions (`to_apply` of a reduce
        or scatter: no kernels of their own). Computations print callees first."""
        times: dict[str, float] = collections.defaultdict(float, {self.entry: 1.0})
        inner: set[str] = set()
        for name in reversed(list(self.computations)):
            for inst in self.computations[name]:
                runs = times[name]
                if inst.opcode == "while":
                    trip = inst.backend_config().get("known_trip_count", {}).get("n", 1)
                    runs *= float(trip)
                callees = re.findall(_CALLEE, inst.attributes)
                branches = re.search(r"branch_computations=\{([^}]*)\}", inst.attributes)
                callees += re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
                for callee in callees:
                    times[callee] += runs
                    self.callers[callee] = inst
                    if inst.opcode not in ("while", "call", "conditional", "async-start"):
                        inner.add(callee)
        return dict(times), inner

    def instructions(self, *, control_only: bool = False) -> Iterator[tuple[Instruction, float]]:
        """`(instruction, runs per call)`; with `control_only`, only those of computations that
        launch kernels (not fusion bodies or scalar functions)."""
        for name, body in self.computations.items():
            runs = self.times.get(name, 0.0)
            if runs and not (control_only and name in self.fused):
                for inst in body:
                    yield inst, runs

    def kernels(self) -> Iterator[tuple[Instruction, float]]:
        """The instructions that launch work, with their runs per call (not a TPU's
        `ConcatBitcast`, a new view of its operands)."""
        for inst, runs in self.instructions(control_only=True):
            if inst.opcode in _NOT_KERNELS or inst.opcode.endswith("-done"):
                continue
            if not (inst.attribute("custom_call_target") or "").endswith("Bitcast"):
                yield inst, runs

    def operand_type(self, inst: Instruction, index: int) -> str:
        return self.types.get(inst.operands[index], "") if index < len(inst.operands) else ""

    def written(self, inst: Instruction) -> list[str]:
        """The types of what one run of the kernel `inst` writes: its results, except where it
        writes a slice into a buffer it was given, in place (a dynamic-update-slice alone, or
        the root of a fusion or of a tuple's element, whose buffer is a fused parameter): that
        writes its update, not the buffer (a scanned layer's slice of a stacked array)."""
        if inst.opcode == "dynamic-update-slice":
            return [self.operand_type(inst, 1)]
        callee = (inst.attribute("calls") or "").lstrip("%")
        body = self.computations.get(callee)
        if inst.opcode != "fusion" or not body:
            return [inst.type]
        by_name = {b.name: b for b in body}
        root = by_name.get(self.roots.get(callee, ""), body[-1])
        found = []
        for name in root.operands if root.opcode == "tuple" else (root.name,):
            made = by_name.get(name)
            while made is not None and made.opcode == "bitcast":
                made = by_name.get(made.operands[0])
            in_place = made is not None and made.opcode == "dynamic-update-slice"
            if in_place and _from_parameter(by_name, made.operands[0]):
                found.append(self.types.get(made.operands[1], ""))  # the update, in place
            else:
                found.append(self.types.get(name, ""))
        return found

    def largest(self, per: int = 1) -> list[dict]:
        """The biggest arrays the kernels write to device memory (`written`: a slice written
        in place counts as the slice), `{array, where, bytes (each), count}`, by bytes in all,
        grouped by type and source line; counts divided by `per`."""
        found: dict[tuple[str, str, int], float] = collections.Counter()
        for inst, runs in self.kernels():
            for dtype, dims in (a for t in self.written(inst) for a in arrays(t, hbm=True)):
                array = f"{dtype}[{','.join(map(str, dims))}]"
                found[(array, self.where(inst), nbytes(dtype, dims))] += runs / per
        rows = sorted(found.items(), key=lambda kv: -kv[0][2] * kv[1])[:8]
        return [{"array": a, "where": w, "bytes": b, "count": n} for (a, w, b), n in rows]

    def attention(self, length: int | None, per: int = 1) -> dict:
        """Which attention runs: a fused kernel's calls (cuDNN's on a GPU; Pallas's flash or
        splash kernels on a TPU, named so in the program), forward and backward, and the
        buffers of `[.., length, length]` a materialised one writes (none looked for without
        `length`); counts divided by `per`."""
        calls: dict[tuple[str, str], float] = collections.Counter()
        count, size, sites, packed = 0.0, 0, set(), False
        for inst, runs in self.kernels():
            target = inst.attribute("custom_call_target") or ""
            if target.startswith(ATTENTION):
                calls["cuDNN", "backward" if "Backward" in target else "forward"] += runs / per
                fmha = inst.backend_config().get("cudnn_fmha_backend_config", {})
                packed |= fmha.get("mask_type") == "PADDING_CAUSAL"  # packed rows' layout
            elif target == "tpu_custom_call" and ("flash" in inst.name or "splash" in inst.name):
                calls["Pallas", "forward" if "fwd" in inst.name else "backward"] += runs / per
            for dtype, dims in arrays(inst.type) if length else ():
                square = len(dims) >= 3 and dims[-2:] == (length, length)
                if square and math.prod(dims) >= 2 * length**2:
                    count, size = count + runs / per, size + nbytes(dtype, dims)
                    sites.add(self.where(inst))
        name = "none found (no fused attention kernel, no [.., L, L] buffer)"
        library = next((lib for lib, way in calls if way == "forward"), None)
        forward, backward = calls[library, "forward"], calls[library, "backward"]
        if library:
            kind = "cuDNN fused flash" if library == "cuDNN" else "Pallas TPU flash"
            name = f"{kind} attention: {forward:g} forward + {backward:g} backward calls"
            name += ", the packed rows' layout (segment lengths)" if packed else ""
            name += "" if count else ", no [B, H, L, L] buffer"
        elif count:
            name = "materialized"
        return {
            "implementation": name,
            "forward_calls": forward,
            "backward_calls": backward,
            "buffers": count,
            "buffer_bytes": size,
            "buffer_sites": sorted(sites),
        }

    def lowering(self, inst: Instruction) -> str:
        """The kernel a matmul runs as: its library call's target, a Triton GEMM fusion (XLA's
        GPU GEMMs where no autotuning chose cuBLAS), or the kind of fusion that holds it."""
        target = inst.attribute("custom_call_target")
        if target:
            return target
        caller = self.callers.get(self.home.get(inst.name, ""))
        config = caller.backend_config() if caller else {}
        kind = config.get("fusion_backend_config", {}).get("kind", "")
        return "Triton GEMM fusion" if "triton" in kind else kind or "XLA fusion"

    def where(self, inst: Instruction) -> str:
        """`file:line` of the user code that made `inst`, else its `op_name`, else its name."""
        frame = inst.attribute("stack_frame_id")
        if frame and frame.isdigit():
            found = self._frames(int(frame))
            if found:
                return found
        file, line = inst.attribute("source_file"), inst.attribute("source_line")
        if file and line and not any(lib in file for lib in _LIBRARIES):
            return f"{_relative(file)}:{line}"
        return inst.attribute("op_name") or inst.name


def _instruction_lines(text: str) -> Iterator[str]:
    """The module's lines, an instruction whose attributes run over several lines (a TPU
    kernel's `frontend_attributes` hold text with line breaks) joined into one."""
    pending = None
    for line in text.splitlines():
        starts = (
            line.rstrip() == "}"
            or not line.startswith((" ", '"', "}"))
            or line.lstrip(" ").startswith(("%", "ROOT "))
        )
        if starts:
            if pending is not None:
                yield pending
            pending = line
        else:
            pending = line if pending is None else pending + " " + line
    if pending is not None:
        yield pending


def _relative(path: str) -> str:
    return os.path.relpath(path) if path.startswith(os.getcwd()) else path


def _frames(text: str):
    """`frame id -> file:line` of the innermost frame outside installed libraries, from the
    module's FileNames / FileLocations / StackFrames tables (empty where there are none). A
    frame's printed parent is one more than the parent's id; 0 or 1 ends the chain."""
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    section = ""
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif not line.strip() or line.startswith(("HloModule", "%", "ENTRY")):
            if tables["StackFrames"] or line.startswith(("%", "ENTRY")):
                break
        elif section and (found := re.match(r"^(\d+) (.*)$", line)):
            tables[section][int(found.group(1))] = found.group(2)
    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    locations = {k: re.findall(r"(\w+)=(\d+)", v) for k, v in tables["FileLocations"].items()}
    frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in tables["StackFrames"].items()}

    def where(frame_id: int) -> str | None:
        seen = set()
        while frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            location = dict(locations.get(int(frames[frame_id]["file_location_id"]), []))
            file = files.get(int(location.get("file_name_id", 0)), "")
            if file and not any(lib in file for lib in _LIBRARIES):
                return f"{_relative(file)}:{location.get('line', '?')}"
            frame_id = int(frames[frame_id].get("parent_frame_id", 0)) - 1
        return None

    return where


VIEWS = {"bitcast", "get-tuple-element"}  # ops that pass a fused parameter on unread


def _from_parameter(by_name: dict, name: str) -> bool:
    """Whether `name` is a fused parameter, through views: a buffer given to the kernel."""
    made = by_name.get(name)
    while made is not None and made.opcode in VIEWS:
        made = by_name.get(made.operands[0])
    return made is not None and made.opcode == "parameter"
