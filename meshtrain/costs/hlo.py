"""The collectives a compiled XLA program runs per call, over which named mesh axes, and how many bytes they move.

Input is the optimized, SPMD-partitioned HLO text, `jax.jit(f).lower(...).compile().as_text()`: the program as
it will run, after XLA has inserted, combined, made asynchronous and scheduled its collectives, so the numbers
describe what the devices do rather than what the Python code asked for. Parsing is plain regular expressions over
the text (no XLA bindings, which change between versions) and takes well under a second on a multi-megabyte module.

How the text maps to mesh axes: device ids in `replica_groups` and `source_target_pairs` are partition ids, the
positions in `mesh.devices.flat` (JAX compiles with that device assignment), so `np.unravel_index(id, shape)` gives
mesh coordinates and a group's axes are the coordinates in which its members differ. Groups are read from every
form XLA prints: explicit `{{0,1},{2,3}}`, `{}` (all devices), iota `[2,4]<=[8]` and `[4,2]<=[2,4]T(1,0)`, and
XLA's own mesh form `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}` (with optional device_ids and sub-axes), which
auto-partitioned reductions use; its axis names are XLA's and are not trusted, only the groups they expand to.

How often each runs: a collective's count is the number of times its computation runs per call, found by walking
the call graph from the ENTRY computation. A `while` body runs its trip count times (`known_trip_count` in the
backend_config, else inferred from the loop condition, else 1 with `trip_count_known=False` and an
`UnknownTripCountWarning`); nested loops multiply; a computation reached from several places sums. Both branches
of a `conditional` are counted once each, so collectives under a conditional are an upper bound.
"""
import bisect
import collections
import dataclasses
import math
import re
import warnings

import jax
import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Collective:
  """All executions of one kind of collective over one set of mesh axes, per call of the program."""
  kind: str  # one of KINDS
  axes: tuple[str, ...]  # mesh axes its device groups span, in mesh order; () if every group is one device
  count: int  # executions per call (static occurrences x trip counts of enclosing loops)
  bytes: int  # per device, summed over the executions: each the larger of its operands and its result
  exact_groups: bool  # False when some group is not a full sub-grid of `axes` (a partial ring, a strided subset)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction of the HLO text, before aggregation: what `collectives` sums, kept for debugging."""
  name: str  # instruction name, without the leading %
  computation: str  # the computation it sits in
  kind: str
  axes: tuple[str, ...]
  count: int  # executions per call; 0 when its computation is unreachable from ENTRY
  bytes_each: int  # per device and execution
  exact_groups: bool
  trip_count_known: bool  # False when an enclosing while loop's trip count was unknown and taken as 1


class UnknownTripCountWarning(UserWarning):
  """Some collective sits in a while loop whose trip count the text does not give; it was counted once per call."""


# The patterns below start with a literal (newline, space, comma) so that the regex engine can skip ahead: with
# `^`/re.M or a lookbehind first, scanning a few megabytes takes ten times longer.
# A computation header starts a line, unindented, and ends with `{`: `[ENTRY ]%name (params) -> shape {`.
_HEADER = re.compile(r"\n(ENTRY[ \t]+)?%?([\w.\-]+)[ \t][^\n]*\{[ \t]*\r?\n")
# A collective opcode (after the shape and a space), synchronous or the -start of its asynchronous form.
_COLLECTIVE = re.compile(r" (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
# Attributes that name called computations.
_CALLS = re.compile(r", (to_apply|calls|body|condition|true_computation|false_computation|branch_computations|"
                    r"called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")  # the first `word(` after ` = `: shapes only hold uppercase T( S( E(
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_GROUPS = re.compile(r"replica_groups=(\{(?:[^{}]|\{[^{}]*\})*\}|\[[\d,]*\]<=\[[\d,]*\](?:T\([\d,]*\))?|"
                     r"mesh\[[^\]]*\](?:,[ \t]*device_ids=\((?:[^()]|\([^()]*\))*\))?[ \t]*\{[^}]*\})")
# XLA's own mesh form: `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, optionally with `, device_ids=([2,4]T(1,0))` between,
# and sub-axes in the braces as `'axis_0':(1)2` (pre-size 1, size 2).
_MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\](?:,[ \t]*device_ids=\(((?:[^()]|\([^()]*\))*)\))?[ \t]*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([^',=\s]+)'?\s*=\s*(\d+)")
_MESH_REF = re.compile(r"'?([^',:{}\s]+)'?(?::\((\d+)\)(\d+))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:[^{}]|\{[^{}]*\})*)\}")
_BRACED = re.compile(r"\{([^{}]*)\}")
_IOTA = re.compile(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_INIT_STEP = re.compile(r'"known_init_step"\s*:\s*\{\s*"init"\s*:\s*"(-?\d+)"\s*,\s*"step"\s*:\s*"(-?\d+)"')
_NUM_PARTITIONS = re.compile(r"^HloModule\b[^\n]*\bnum_partitions=(\d+)", re.M)
_BITS = {"pred": 8, "token": 0, "c64": 64, "c128": 128}


def collectives(hlo_text: str, mesh: jax.sharding.Mesh) -> list[Collective]:
  """Aggregated by (kind, axes), sorted by bytes descending.

  Collectives under a `conditional` count every branch (an upper bound). A loop with an unknown trip count counts
  once and emits an `UnknownTripCountWarning`; `parse_ops` says which instructions that affects.
  """
  ops = parse_ops(hlo_text, mesh)
  unknown = sorted({op.name for op in ops if not op.trip_count_known and op.count})
  if unknown:
    warnings.warn(f"{len(unknown)} collective(s) sit in while loops of unknown trip count and were counted once per "
                  f"loop: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}", UnknownTripCountWarning,
                  stacklevel=2)
  totals: dict[tuple[str, tuple[str, ...]], list] = {}
  for op in ops:
    if not op.count:
      continue
    total = totals.setdefault((op.kind, op.axes), [0, 0, True])
    total[0] += op.count
    total[1] += op.count * op.bytes_each
    total[2] = total[2] and op.exact_groups
  result = [Collective(kind, axes, count, nbytes, exact) for (kind, axes), (count, nbytes, exact) in totals.items()]
  return sorted(result, key=lambda c: (-c.bytes, c.kind, c.axes))


_DOT = re.compile(r" dot\(")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def dot_flops(hlo_text: str) -> float:
  """FLOPs of every dot in the program per call (2 x output elements x contracted size, x loop trip counts).

  XLA's own `cost_analysis()` counts a while body once, so under a scan over layers it reports about one layer's
  work; this walks the same call graph as the collectives. Dots are nearly all of a transformer's FLOPs; the
  elementwise work is not counted.
  """
  module = _Module(hlo_text)
  counts, _ = module.counts()
  shapes: dict[str, str] = {}
  for line in hlo_text.splitlines():
    head = _head(line)
    if head:
      shapes[head[0]] = head[1]
  total = 0.0
  for m in _DOT.finditer(hlo_text):
    at = m.start() + 1
    comp = module.computation_at(at)
    line_start, line_end = _line_bounds(hlo_text, at)
    line = hlo_text[line_start:line_end]
    head = _head(line)
    if comp is None or head is None or line_start + head[2] != at or not counts.get(comp):
      continue
    out = _ARRAY.search(head[1])
    lhs = _operand_names(line[head[2]:])[:1]
    lhs_shape = _ARRAY.search(shapes.get(lhs[0], "")) if lhs else None
    contracting = _CONTRACTING.search(line)
    if out is None or lhs_shape is None:
      continue
    out_elems = math.prod(int(d) for d in out.group(2).split(",") if d) if out.group(2) else 1
    lhs_dims = [int(d) for d in lhs_shape.group(2).split(",") if d]
    k = math.prod(lhs_dims[int(i)] for i in contracting.group(1).split(",") if i) if contracting else 1
    total += counts[comp] * 2.0 * out_elems * k
  return total


def parse_ops(hlo_text: str, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> list[CollectiveOp]:
  """Every collective instruction in text order, with its own count and per-execution bytes.

  `mesh` is a `jax.sharding.Mesh` (or AbstractMesh): only its axis names and sizes are used, since partition ids
  are row-major positions in that shape.
  """
  names, sizes = tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes)
  size = math.prod(sizes)
  declared = _NUM_PARTITIONS.search(hlo_text)
  if declared and int(declared.group(1)) not in (1, size):
    raise ValueError(f"the HLO module has num_partitions={declared.group(1)} but the mesh has {size} devices "
                     f"({dict(zip(names, sizes))}); pass the mesh the program was compiled for")
  module = _Module(hlo_text)
  counts, known = module.counts()
  groups_cache: dict[str, tuple[tuple[int, ...], bool, int]] = {}
  ops = []
  for m in _COLLECTIVE.finditer(hlo_text):
    at = m.start() + 1  # the opcode, after the space
    comp = module.computation_at(at)
    line_start, line_end = _line_bounds(hlo_text, at)
    line = hlo_text[line_start:line_end]
    head = _head(line)
    if comp is None or head is None or line_start + head[2] != at:
      continue  # not this line's opcode (e.g. text inside metadata)
    name, shape, _ = head
    kind, is_start = m.group(1), bool(m.group(2))
    operands = _operands(hlo_text, m.end(), line_end)
    if kind == "collective-permute":
      pairs = _PAIRS.search(line)
      key = "p" + (pairs.group(1) if pairs else "")
      if key not in groups_cache:
        groups_cache[key] = _permute_axes(_braced_ints(pairs.group(1)) if pairs else [], sizes)
    else:
      groups = _GROUPS.search(line)
      if groups is None and "replica_groups=" in line:  # a form this parser does not know: never guess "everyone"
        raise ValueError(f"cannot read the replica groups of {name}: {line.strip()[:300]}")
      key = "g" + (groups.group(1) if groups else "{}")  # no attribute at all: one group of every device
      if key not in groups_cache:
        groups_cache[key] = _group_axes(_parse_groups(key[1:], size), sizes, size)
    axes, exact, group_size = groups_cache[key]
    nbytes = max(_result_bytes(shape, kind, is_start, group_size),
                 sum(_array_bytes(d, dims) for d, dims in _ARRAY.findall(operands)))
    ops.append(CollectiveOp(name, comp, kind, tuple(names[a] for a in axes), counts.get(comp, 0), nbytes, exact,
                            known.get(comp, True)))
  return ops


class _Module:
  """The computations of an HLO text (as offsets into it) and the call graph between them."""

  def __init__(self, text: str):
    self.text = text
    self.starts, self.names, self.entry = [], [], None
    for m in _HEADER.finditer("\n" + text):  # the leading newline lets a header start the text
      self.starts.append(m.start())  # the newline's offset in "\n" + text is the header's offset in text
      self.names.append(m.group(2))
      if m.group(1):
        self.entry = m.group(2)
    if self.entry is None:
      raise ValueError("no ENTRY computation in the HLO text; pass the whole module, e.g. compiled.as_text()")
    self.index = {name: i for i, name in enumerate(self.names)}

  def computation_at(self, pos: int) -> str | None:
    i = bisect.bisect_right(self.starts, pos) - 1
    return self.names[i] if i >= 0 else None

  def span(self, name: str) -> tuple[int, int]:
    i = self.index[name]
    end = self.starts[i + 1] if i + 1 < len(self.starts) else len(self.text)
    return self.starts[i], end

  def counts(self) -> tuple[dict[str, int], dict[str, bool]]:
    """Executions per call of every computation reachable from ENTRY, and whether all its loop trip counts were known.

    Edges carry a multiplier: a while body its trip count, the condition one more, everything else (call,
    conditional branches, async-start wrappers, fusions, to_apply) once. `-done` and `-update` halves of async
    pairs name the same wrapped computation as their `-start` and are skipped so it is not counted twice.
    """
    text = self.text
    edges: dict[str, list[tuple[str, int, bool]]] = collections.defaultdict(list)
    lines: dict[int, tuple[bool, int | None]] = {}  # line start -> (skip, trip count)
    for m in _CALLS.finditer(text):
      caller = self.computation_at(m.start())
      if caller is None:
        continue
      line_start, line_end = _line_bounds(text, m.start())
      if line_start not in lines:
        line = text[line_start:line_end]
        head = _head(line)
        opcode = line[head[2]:].split("(", 1)[0] if head else ""
        skip = head is None or opcode.endswith(("-done", "-update"))
        trip = self._trip_count(line, caller) if opcode == "while" else None
        lines[line_start] = (skip, trip)
      skip, trip = lines[line_start]
      if skip:
        continue
      attr, value = m.group(1), m.group(2)
      callees = [v.strip().lstrip("%") for v in value.strip("{}").split(",")]  # one name, or `{%a, %b}`
      mult, trip_known = 1, True
      if attr in ("body", "condition"):
        trip_known = trip is not None
        mult = (trip if trip_known else 1) + (attr == "condition")  # the condition runs once more than the body
      edges[caller].extend((c, mult, trip_known) for c in callees if c in self.index)
    order, seen, stack = [], {self.entry}, [(self.entry, iter(edges[self.entry]))]
    while stack:  # depth-first postorder from ENTRY; its reverse visits callers before callees
      node, it = stack[-1]
      for callee, _, _ in it:
        if callee not in seen:
          seen.add(callee)
          stack.append((callee, iter(edges[callee])))
          break
      else:
        order.append(node)
        stack.pop()
    counts, known = {self.entry: 1}, {self.entry: True}
    for node in reversed(order):
      for callee, mult, edge_known in edges[node]:
        counts[callee] = counts.get(callee, 0) + counts[node] * mult
        known[callee] = known.get(callee, True) and known[node] and edge_known
    return counts, known

  def _trip_count(self, line: str, caller: str) -> int | None:
    """The while loop's trip count: XLA's `known_trip_count`, else read from its condition, else None."""
    m = _TRIP.search(line)
    if m:
      return int(m.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", line)
    if not cond or cond.group(1) not in self.index:
      return None
    init_step = _INIT_STEP.search(line)
    return self._trip_from_condition(line, caller, cond.group(1), init_step)

  def _trip_from_condition(self, line: str, caller: str, cond: str, init_step) -> int | None:
    """Reads `induction variable <direction> constant` from the condition's ROOT (a compare, possibly fused).

    The induction variable's start comes from `known_init_step` or from the constant fed into the loop tuple;
    its step from `known_init_step`, else it is assumed to be +1 (what scan and fori_loop lower to).
    """
    root = self._root(cond)
    if root is None:
      return None
    opcode, operands, attrs = root
    direction = re.search(r"\bdirection=(\w+)", attrs)
    if opcode == "fusion":  # CPU and GPU wrap the compare: map the fused parameters back to the fusion operands
      called = re.search(r"\bcalls=%?([\w.\-]+)", attrs)
      inner = self._root(called.group(1)) if called and called.group(1) in self.index else None
      if inner is None or inner[0] != "compare":
        return None
      params = self._parameter_numbers(called.group(1))
      try:
        operands = [operands[params[name]] for name in inner[1]]
      except (KeyError, IndexError):
        return None
      direction = re.search(r"\bdirection=(\w+)", inner[2])
    elif opcode != "compare":
      return None
    if direction is None or len(operands) != 2:
      return None
    defs = [self._definition(cond, name) for name in operands]
    if None in defs:
      return None
    constants = [_constant(d) for d in defs]
    tuple_index = [re.search(r"get-tuple-element\(.*\bindex=(\d+)", d) for d in defs]
    flip = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE", "NE": "NE"}
    if constants[1] is not None and tuple_index[0]:
      limit, index, op = constants[1], int(tuple_index[0].group(1)), direction.group(1)
    elif constants[0] is not None and tuple_index[1]:
      limit, index, op = constants[0], int(tuple_index[1].group(1)), flip.get(direction.group(1), "")
    else:
      return None
    if init_step:
      start, step = int(init_step.group(1)), int(init_step.group(2))
    else:
      start, step = self._loop_init(line, caller, index), 1
    if start is None or step <= 0:
      return None
    if op == "LT":
      return max(0, -(-(limit - start) // step))
    if op == "LE":
      return max(0, (limit - start) // step + 1)
    if op == "NE" and limit >= start and (limit - start) % step == 0:
      return (limit - start) // step
    return None

  def _loop_init(self, line: str, caller: str, index: int) -> int | None:
    """The constant the loop tuple's element `index` starts from, following copies; None if not a constant."""
    head = _head(line)
    operands = _operand_names(line[head[2]:]) if head else []
    if len(operands) != 1:
      return None
    loop_tuple = self._definition(caller, operands[0])
    if loop_tuple is None or _head(loop_tuple) is None:
      return None
    opcode_at = _head(loop_tuple)[2]
    if not loop_tuple.startswith("tuple(", opcode_at):
      return None
    elements = _operand_names(loop_tuple[opcode_at:])
    name = elements[index] if index < len(elements) else None
    for _ in range(8):
      definition = self._definition(caller, name) if name else None
      if definition is None:
        return None
      value = _constant(definition)
      if value is not None:
        return value
      head = _head(definition)
      if head is None or not definition.startswith("copy(", head[2]):
        return None
      name = _operand_names(definition[head[2]:])[0]
    return None

  def _root(self, comp: str) -> tuple[str, list[str], str] | None:
    """(opcode, operand names, the rest of the line) of a computation's ROOT instruction."""
    start, end = self.span(comp)
    m = re.compile(r"^[ \t]*ROOT[ \t]+[^\n]*", re.M).search(self.text, start, end)
    if not m:
      return None
    line = m.group(0)
    head = _head(line)
    if head is None:
      return None
    rest = line[head[2]:]
    opcode = rest.split("(", 1)[0]
    return opcode, _operand_names(rest), rest

  def _definition(self, comp: str, name: str) -> str | None:
    """The line that defines instruction `name` in computation `comp`."""
    start, end = self.span(comp)
    pattern = re.compile(r"^[ \t]*(?:ROOT[ \t]+)?%?" + re.escape(name) + r"[ \t]*=[^\n]*", re.M)
    m = pattern.search(self.text, start, end)
    return m.group(0) if m else None

  def _parameter_numbers(self, comp: str) -> dict[str, int]:
    start, end = self.span(comp)
    found = re.finditer(r"^[ \t]*%?([\w.\-]+)[ \t]*=[^\n]*?\bparameter\((\d+)\)", self.text[start:end], re.M)
    return {m.group(1): int(m.group(2)) for m in found}


def _line_bounds(text: str, pos: int) -> tuple[int, int]:
  end = text.find("\n", pos)
  return text.rfind("\n", 0, pos) + 1, len(text) if end < 0 else end


def _head(line: str) -> tuple[str, str, int] | None:
  """(name, shape, offset of the opcode) of an instruction line `[ROOT ]%name = shape opcode(...)`."""
  eq = line.find(" = ")
  if eq < 0:
    return None
  m = _OPCODE.search(line, eq + 3)
  if m is None:
    return None
  name = line[:eq].strip()
  if name.startswith("ROOT "):
    name = name[5:].strip()
  return name.lstrip("%"), line[eq + 3:m.start()].strip(), m.start()


def _operands(text: str, start: int, limit: int) -> str:
  """The operand list that starts at `start` (just after the opcode's parenthesis), up to its closing one."""
  depth = 1
  for i in range(start, limit):
    c = text[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth == 0:
        return text[start:i]
  return text[start:limit]


def _operand_names(call: str) -> list[str]:
  """Operand names of `opcode(a, b)` or `opcode(f32[2,8]{1,0} %a, ...)`."""
  inside = _operands(call, call.index("(") + 1, len(call))
  return [part.split()[-1].lstrip("%") for part in _split_top(inside) if part.strip()]


def _split_top(s: str) -> list[str]:
  """Splits at commas outside any brackets."""
  parts, depth, begin = [], 0, 0
  for i, c in enumerate(s):
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and depth == 0:
      parts.append(s[begin:i])
      begin = i + 1
  parts.append(s[begin:])
  return parts


def _constant(definition: str) -> int | None:
  m = re.search(r"\bconstant\((-?\d+)\)", definition)
  return int(m.group(1)) if m else None


def _array_bytes(dtype: str, dims: str) -> int:
  bits = _BITS.get(dtype)
  if bits is None:
    digits = re.search(r"\d+", dtype)
    bits = int(digits.group(0)) if digits else 0
  # `<=8` is a dynamic dimension's bound; an unbounded `?` counts as 0.
  elements = math.prod(int(re.sub(r"\D", "", d) or 0) for d in dims.split(",")) if dims.strip() else 1
  return -(-elements * bits // 8)


def _shape_bytes(shape: str) -> int:
  return sum(_array_bytes(d, dims) for d, dims in _ARRAY.findall(shape))


def _result_bytes(shape: str, kind: str, is_start: bool, group_size: int) -> int:
  """Bytes of the larger of operand and result that the instruction's own shape shows.

  Synchronous collectives (and all-reduce-start) have the result as shape: a tuple of several results is summed.
  The other -start forms hold `(operands, results[, context])`: the largest component is the buffer. A
  reduce-scatter's result is 1/group_size of its input, which the text may not print.
  """
  if is_start and kind != "all-reduce" and shape.startswith("("):
    parts = [_shape_bytes(p) for p in _split_top(shape[1:-1])]
    result = parts[1] if len(parts) > 1 else parts[0]
    return max(max(parts), result * group_size if kind == "reduce-scatter" else 0)
  total = _shape_bytes(shape)
  return total * group_size if kind == "reduce-scatter" else total


def _braced_ints(s: str) -> list[list[int]]:
  return [[int(x) for x in g.split(",") if x.strip()] for g in _BRACED.findall(s)]


def _parse_groups(value: str, size: int) -> list[list[int]]:
  """Device groups from `{{0,1},{2,3}}`, `{}` (all devices), `[2,4]<=[8]`, `[4,2]<=[2,4]T(1,0)` or XLA's mesh form."""
  if value.startswith("mesh"):
    return _mesh_groups(value)
  iota = _IOTA.fullmatch(value)
  if iota:
    shape = [int(x) for x in iota.group(1).split(",")]
    dims = [int(x) for x in iota.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
    return ids.reshape(-1, shape[-1]).tolist()
  groups = [g for g in _braced_ints(value[1:-1]) if g]
  return groups or [list(range(size))]


def _mesh_groups(value: str) -> list[list[int]]:
  """Groups of `mesh[a=2,b=4], device_ids=(...) {b}`: devices that differ only along the listed (sub-)axes.

  Follows XLA's MeshAxesReplicaGroupList: an axis holding sub-axes `b:(pre)size` is reshaped into [pre, size, rest]
  (padding dimensions where sub-axes leave gaps), then the listed dimensions are transposed last, in listed order,
  and the device array is cut into consecutive groups. The axis names are XLA's, unrelated to the JAX mesh's.
  """
  m = _MESH_GROUPS.fullmatch(value)
  if m is None:
    raise ValueError(f"cannot read replica groups {value!r}")
  axes = _MESH_AXIS.findall(m.group(1))
  names, dims = [a for a, _ in axes], [int(s) for _, s in axes]
  count = math.prod(dims)
  ids = np.arange(count)
  if m.group(2):
    iota = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", m.group(2))
    if iota:
      ids = ids.reshape([int(x) for x in iota.group(1).split(",")])
      if iota.group(2):
        ids = ids.transpose([int(x) for x in iota.group(2).split(",")])
    else:  # an explicit list, possibly after its `[dims]`
      listed = [int(x) for x in re.findall(r"\d+", re.sub(r"^\s*\[[\d,]*\]", "", m.group(2)))]
      if len(listed) != count:
        raise ValueError(f"cannot read the device ids of replica groups {value!r}")
      ids = np.array(listed)
  refs = [(names.index(name), int(pre) if pre else None, int(sub) if sub else None)
          for name, pre, sub in _MESH_REF.findall(m.group(3)) if name in names]
  shape, grouped = [], [0] * len(refs)
  for axis, full in enumerate(dims):
    mine = sorted((pre or 1, k, sub) for k, (a, pre, sub) in enumerate(refs) if a == axis)
    if not mine:
      shape.append(full)
      continue
    prefix = 1
    for pre, k, sub in mine:
      if pre != prefix:  # a gap before this sub-axis
        shape.append(pre // prefix)
        prefix = pre
      grouped[k] = len(shape)
      shape.append(sub or full)
      prefix *= sub or full
    if prefix != full:
      shape.append(full // prefix)
  rest = [d for d in range(len(shape)) if d not in grouped]
  group_size = math.prod(shape[d] for d in grouped)
  return ids.reshape(shape).transpose(rest + grouped).reshape(-1, group_size).tolist()


def _group_axes(groups: list[list[int]], sizes: tuple[int, ...], size: int) -> tuple[tuple[int, ...], bool, int]:
  """(mesh axes the groups span, whether every group is a full sub-grid of the same axes, largest group size)."""
  if any(i < 0 or i >= size for g in groups for i in g):
    raise ValueError(f"device id outside the mesh's {size} devices in replica groups {groups[:4]}...; pass the mesh "
                     f"the program was compiled for")
  by_size = collections.defaultdict(list)
  for g in groups:
    by_size[len(g)].append(g)
  axes, exact = set(), len(by_size) == 1  # groups of different sizes cannot all be sub-grids of the same axes
  for length, same in by_size.items():
    coords = np.stack(np.unravel_index(np.array(same), sizes))  # [axis, group, member]
    differs = (coords != coords[..., :1]).any(-1)  # [axis, group]: the axes each group spans
    axes.update(np.flatnonzero(differs.any(1)).tolist())
    spanned = np.where(differs, np.array(sizes)[:, None], 1).prod(0)
    exact = exact and bool((spanned == length).all()) and bool((differs == differs[:, :1]).all())
  return tuple(sorted(axes)), exact, max(by_size)


def _permute_axes(pairs: list[list[int]], sizes: tuple[int, ...]) -> tuple[tuple[int, ...], bool, int]:
  """Axes along which sources and targets differ; exact when the pairs close into full rings over those axes.

  The pairs split into connected cycles; each must be a permutation of its members (every device sends once and
  receives once) spanning a full sub-grid, so a pipeline shift that does not wrap around reports False.
  """
  size = math.prod(sizes)
  pairs = [p for p in pairs if len(p) == 2]
  if any(i < 0 or i >= size for p in pairs for i in p):
    raise ValueError(f"device id outside the mesh's {size} devices in source_target_pairs; pass the mesh the "
                     f"program was compiled for")
  if not pairs:
    return (), True, 1
  array = np.array(pairs)
  coords = np.stack(np.unravel_index(array, sizes))  # [axis, pair, 2]
  axes = tuple(np.flatnonzero((coords[..., 0] != coords[..., 1]).any(1)).tolist())
  parent = list(range(size))

  def find(i: int) -> int:
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  for s, t in pairs:
    parent[find(s)] = find(t)
  sources, targets = collections.Counter(array[:, 0].tolist()), collections.Counter(array[:, 1].tolist())
  members = collections.defaultdict(set)
  for s, t in pairs:
    members[find(s)].update((s, t))
  exact = True
  for group in members.values():
    if any(sources[i] != 1 or targets[i] != 1 for i in group):
      exact = False
      break
  if exact:
    axes_in, exact, _ = _group_axes([sorted(g) for g in members.values()], sizes, size)
    exact = exact and axes_in == axes
  return axes, exact, max(len(g) for g in members.values())
