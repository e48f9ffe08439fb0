"""Collectives read from compiled HLO text: hand-written snippets for each syntax variant, then real programs."""
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from meshtrain.costs import hlo
from meshtrain.costs.hlo import Collective
from meshtrain.mesh import AXES, make_mesh


@pytest.fixture(scope="module")
def mesh() -> Mesh:
  return make_mesh({"data": 2, "tensor": 4})  # partition id = 4 * data + tensor


def by_name(text: str, mesh: Mesh) -> dict[str, hlo.CollectiveOp]:
  return {op.name: op for op in hlo.parse_ops(text, mesh)}


ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

GROUPS = "HloModule groups, num_partitions=8\n" + ADD + """
ENTRY %main (p: f32[4,8], q: bf16[2]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %q = bf16[2]{0} parameter(1)
  %iota = f32[4,8]{1,0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %transposed = f32[4,8]{1,0:S(1)} all-reduce(%iota), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %explicit = (f32[4,8]{1,0}, bf16[2]{0}) all-reduce(%transposed, %q), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %everyone = pred[3]{0} all-reduce(pred[3]{0} %r), channel_id=4, replica_groups={}, to_apply=%add
  %pairs = f32[8,8]{1,0} all-gather(f32[2,8]{1,0} %p), channel_id=5, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, use_global_device_ids=true
  %alone = s8[5]{0} all-to-all(s8[5]{0} %s), channel_id=6, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, dimensions={0}
  ROOT %out = f32[4,8]{1,0} copy(%p)
}
"""  # noqa: E501


def test_replica_group_forms_give_mesh_axes_and_bytes(mesh):
  ops = by_name(GROUPS, mesh)
  assert [(n, o.axes, o.bytes_each, o.exact_groups) for n, o in ops.items()] == [
      ("iota", ("tensor",), 128, True),  # [2,4]<=[8]: {0,1,2,3},{4,5,6,7}
      ("transposed", ("data",), 128, True),  # [4,2]<=[2,4]T(1,0): {0,4},{1,5},...; memory space S(1) ignored
      ("explicit", ("data", "tensor"), 4 * 8 * 4 + 2 * 2, True),  # tuple: f32 and bf16 summed
      ("everyone", ("data", "tensor"), 3, True),  # {} is one group of all devices; pred is a byte
      ("pairs", ("tensor",), 8 * 8 * 4, False),  # half of each tensor row: not a full sub-grid
      ("alone", (), 5, True),  # single-device groups span no axis
  ]
  assert all(o.count == 1 and o.computation == "main" for o in ops.values())


def test_xla_mesh_form_of_replica_groups(mesh):
  # Auto-partitioned reductions print XLA's own mesh (axis names unrelated to JAX's), optionally with device ids
  # and sub-axes `'a':(pre)size`; the groups are what count.
  assert hlo._parse_groups("mesh['a'=2,'b'=4] {'b'}", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert hlo._parse_groups("mesh['a'=2,'b'=4] {'a'}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert hlo._parse_groups("mesh['a'=8] {'a':(2)2}", 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
  assert hlo._parse_groups("mesh['a'=8] {'a':(1)2,'a':(4)2}", 8) == [[0, 1, 4, 5], [2, 3, 6, 7]]
  assert hlo._parse_groups("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert hlo._parse_groups("mesh['a'=2,'b'=4] {}", 8) == [[i] for i in range(8)]
  line = ("  %{name} = f32[4]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, use_global_device_ids=true, "
          "to_apply=%add\n")
  forms = {"plain": "mesh['axis_0'=2,'axis_1'=4] {'axis_1'}",
           "ids": "mesh['axis_0'=1,'axis_1'=2,'axis_2'=2,'axis_3'=2], device_ids=([2,2,2]T(2,1,0)) {'axis_3'}",
           "sub": "mesh['axis_0'=2,'axis_1'=4] {'axis_1':(2)2}"}
  text = ("HloModule m, num_partitions=8\n" + ADD + "\nENTRY %main (p: f32[4]) -> f32[4] {\n"
          + "".join(line.format(name=n, groups=g) for n, g in forms.items()) + "  ROOT %out = f32[4]{0} copy(%p)\n}\n")
  assert [(o.name, o.axes, o.exact_groups) for o in hlo.parse_ops(text, mesh)] == [
      ("plain", ("tensor",), True), ("ids", ("data",), True), ("sub", ("tensor",), False)]


ASYNC = "HloModule async, num_partitions=8\n" + ADD + """
%wrapped_all_to_all (x: f32[16]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  ROOT %a2a = f32[16]{0} all-to-all(%x), channel_id=6, replica_groups=[2,4]<=[8], dimensions={0}
}

ENTRY %main (p: f32[4,8], y: f32[16]) -> f32[8,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %ags = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %ars = bf16[16]{0} all-reduce-start(%z), channel_id=2, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = bf16[16]{0} all-reduce-done(%ars)
  %cps = (f32[4,4]{1,0}, f32[4,4]{1,0}, u32[], u32[]) collective-permute-start(%w), channel_id=3, source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}
  %cpd = f32[4,4]{1,0} collective-permute-done(%cps)
  %rss = ((f32[4,8]{1,0}), f32[1,8]{1,0}) reduce-scatter-start(%p), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %rsu = ((f32[4,8]{1,0}), f32[1,8]{1,0}) reduce-scatter-update(%rss)
  %rsd = f32[1,8]{1,0} reduce-scatter-done(%rsu)
  %as = ((f32[16]{0}), f32[16]{0}, s32[]) async-start(%y), calls=%wrapped_all_to_all
  %ad = f32[16]{0} async-done(%as), calls=%wrapped_all_to_all
  ROOT %out = f32[8,8]{1,0} copy(%agd)
}
"""  # noqa: E501


def test_async_pairs_counted_once_with_their_buffer(mesh):
  assert hlo.collectives(ASYNC, mesh) == [
      Collective("all-gather", ("tensor",), 1, 8 * 8 * 4, True),  # the gathered buffer, not operand + result
      Collective("reduce-scatter", ("tensor",), 1, 4 * 8 * 4, True),  # the full input
      Collective("all-to-all", ("tensor",), 1, 16 * 4, True),  # inside the async-start's wrapped computation
      Collective("collective-permute", ("data",), 1, 4 * 4 * 4, True),  # not the u32 context
      Collective("all-reduce", ("tensor",), 1, 16 * 2, True),  # bf16
  ]


LOOPS = "HloModule loops, num_partitions=8\n" + ADD + """
%shared (s: f32[4]) -> f32[4] {
  %s = f32[4]{0} parameter(0)
  ROOT %shared_gather = f32[4]{0} all-gather(%s), channel_id=9, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
}

%inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %inner_sum = f32[4]{0} all-reduce(%v), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %inner_sum)
}

%inner_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%branch_a (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  ROOT %branch_sum = f32[4]{0} all-reduce(%b), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%branch_b (b: f32[4]) -> f32[4] {
  %b = f32[4]{0} parameter(0)
  ROOT %branch_gather = f32[4]{0} all-gather(%b), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

%outer_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %inner = (s32[], f32[4]{0}) while(%t), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
  %v = f32[4]{0} get-tuple-element(%inner), index=1
  %c = f32[4]{0} call(%v), to_apply=%shared
  %i = s32[] get-tuple-element(%inner), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %c)
}

%outer_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%guess_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %limit = s32[] constant(8)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %gt = pred[] compare(%limit, %i), direction=GT
}

ENTRY %main (p: f32[4], k: s32[]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %k = s32[] parameter(1)
  %zero = s32[] constant(2)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[4]{0}) tuple(%start, %p)
  %outer = (s32[], f32[4]{0}) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %guessed = (s32[], f32[4]{0}) while(%init), condition=%guess_cond, body=%inner_body
  %x = f32[4]{0} get-tuple-element(%outer), index=1
  %once = f32[4]{0} call(%x), to_apply=%shared
  %cond = f32[4]{0} conditional(%k, %once, %once), branch_computations={%branch_a, %branch_b}
  ROOT %out = f32[4]{0} copy(%cond)
}
"""  # noqa: E501


def test_nested_loops_calls_and_branches_multiply_counts(mesh):
  ops = hlo.parse_ops(LOOPS, mesh)
  counts = [(o.name, o.computation, o.count, o.trip_count_known) for o in ops]
  assert counts == [
      ("shared_gather", "shared", 1 + 3, True),  # called once from ENTRY and once per outer iteration
      ("inner_sum", "inner_body", 3 * 4 + 6, True),  # 3 x 4 nested, plus 6 from the guessed loop: 8 - 2
      ("branch_sum", "branch_a", 1, True),  # each conditional branch once (an upper bound)
      ("branch_gather", "branch_b", 1, True),
  ]
  assert hlo.collectives(LOOPS, mesh)[0] == Collective("all-reduce", ("tensor",), 18, 18 * 16, True)


def test_unknown_trip_count_counts_once_and_warns(mesh):
  text = LOOPS.replace("constant(8)", "parameter(1)")  # the guessed loop's bound is no longer a constant
  ops = by_name(text, mesh)
  assert (ops["inner_sum"].count, ops["inner_sum"].trip_count_known) == (3 * 4 + 1, False)
  assert ops["shared_gather"].trip_count_known
  with pytest.warns(hlo.UnknownTripCountWarning, match="inner_sum"):
    hlo.collectives(text, mesh)


def test_permute_pairs_give_axis_and_partial_rings_are_inexact(mesh):
  template = "HloModule p, num_partitions=8\nENTRY %main (p: f32[4]) -> f32[4] {\n" \
             "  ROOT %cp = f32[4]{0} collective-permute(f32[4]{0} %p), channel_id=1, source_target_pairs={%s}\n}\n"
  ring = "{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}"
  assert hlo.collectives(template.replace("%s", ring), mesh) == [
      Collective("collective-permute", ("tensor",), 1, 16, True)]
  shift = "{0,1},{1,2},{2,3},{4,5},{5,6},{6,7}"  # a pipeline shift that does not wrap around
  assert hlo.collectives(template.replace("%s", shift), mesh) == [
      Collective("collective-permute", ("tensor",), 1, 16, False)]
  both = "{0,5},{5,0}"  # diagonal: data and tensor both change
  assert hlo.collectives(template.replace("%s", both), mesh)[0].axes == ("data", "tensor")


def test_wrong_mesh_or_partial_text_is_an_error(mesh):
  with pytest.raises(ValueError, match="num_partitions=16"):
    hlo.collectives(GROUPS.replace("num_partitions=8", "num_partitions=16"), mesh)
  with pytest.raises(ValueError, match="no ENTRY"):
    hlo.collectives(ADD, mesh)
  with pytest.raises(ValueError, match="cannot read the replica groups of iota"):  # never guessed as all devices
    hlo.collectives(GROUPS.replace("replica_groups=[2,4]<=[8]", "replica_groups=<2x4>"), mesh)


def big_module(n: int) -> str:
  """An HLO module of n fusions of 12 instructions each and n all-reduces over the tensor axis."""
  fusions = "".join(f"%fused_{i} (p: f32[128,256]) -> f32[128,256] {{\n"
                    + f"  %m{i} = f32[128,256]{{1,0}} multiply(%p, %p), metadata={{op_name=\"jit(f)/mul\"}}\n" * 10
                    + f"  ROOT %r{i} = f32[128,256]{{1,0}} add(%p, %p)\n}}\n\n" for i in range(n))
  entry = "".join(f"  %fusion.{i} = f32[128,256]{{1,0}} fusion(%p0), kind=kLoop, calls=%fused_{i}\n"
                  f"  %ar.{i} = f32[128,256]{{1,0}} all-reduce(%fusion.{i}), channel_id={i}, "
                  f"replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%fused_0\n" for i in range(n))
  return (f"HloModule big, num_partitions=8\n{fusions}ENTRY %main (p0: f32[128,256]) -> f32[128,256] {{\n"
          f"  %p0 = f32[128,256]{{1,0}} parameter(0)\n{entry}  ROOT %t = f32[128,256]{{1,0}} copy(%p0)\n}}\n")


def test_multi_megabyte_text_parses_in_linear_time(mesh):
  # A real step's text is several MB: parsing must grow linearly with it. Checked as a ratio of two sizes, not as a
  # wall-clock bound, which a loaded CI machine once broke (1.4 s > 1 s; 0.07 s here): the process's CPU time (not
  # the wall clock, which other processes' load inflates), the best of 3 rounds measured in turn. 10x the text is
  # about 10x the time when linear, 100x if some pass were quadratic; 30 leaves 3x for noise.
  small, large = big_module(300), big_module(3000)
  assert len(large) > 3_000_000
  best = {len(small): float("inf"), len(large): float("inf")}
  for _ in range(3):
    for text in (small, large):
      start = time.process_time()
      hlo.collectives(text, mesh)
      best[len(text)] = min(best[len(text)], time.process_time() - start)
  assert best[len(large)] / best[len(small)] < 30, best
  assert hlo.collectives(large, mesh) == [Collective("all-reduce", ("tensor",), 3000, 3000 * 128 * 256 * 4, True)]


# Real programs, compiled on the 8 CPU devices. Each block is [4, 8] f32 = 128 bytes per device.
X = jnp.arange(8 * 32, dtype=jnp.float32).reshape(8, 32)


def compiled(mesh: Mesh, f, in_specs, out_specs, *args) -> str:
  mapped = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  return jax.jit(mapped).lower(*args).compile().as_text()


def test_psum_over_named_axes(mesh):
  assert mesh.axis_names == AXES
  text = compiled(mesh, lambda a: jax.lax.psum(a, "tensor"), P("data", "tensor"), P("data"), X)
  assert hlo.collectives(text, mesh) == [Collective("all-reduce", ("tensor",), 1, 128, True)]
  text = compiled(mesh, lambda a: jax.lax.psum(a, ("data", "tensor")), P("data", "tensor"), P(), X)
  assert hlo.collectives(text, mesh) == [Collective("all-reduce", ("data", "tensor"), 1, 128, True)]


def test_auto_partitioned_reductions(mesh):
  # XLA prints these with its own mesh form of replica groups in this JAX version; either form must map back.
  x = jax.device_put(X, jax.sharding.NamedSharding(mesh, P("data", "tensor")))
  text = jax.jit(lambda a: (a.sum(1), a.max(0))).lower(x).compile().as_text()
  assert hlo.collectives(text, mesh) == [Collective("all-reduce", ("data",), 1, 8 * 4, True),  # max(0): f32[8]
                                         Collective("all-reduce", ("tensor",), 1, 4 * 4, True)]  # sum(1): f32[4]


def test_device_ids_are_mesh_positions_not_device_ids():
  # Devices laid out column-major: position 1 holds device 2. Device ids would make the tensor group {0,2,4,6}.
  shuffled = np.array(jax.devices()).reshape(4, 2).T.reshape(1, 2, 1, 1, 1, 4)
  mesh = Mesh(shuffled, AXES)
  assert [d.id for d in mesh.devices.flat][:2] == [0, 2]
  text = compiled(mesh, lambda a: jax.lax.psum(a, "tensor"), P("data", "tensor"), P("data"), X)
  assert hlo.collectives(text, mesh) == [Collective("all-reduce", ("tensor",), 1, 128, True)]


def test_psum_in_scan_runs_per_iteration(mesh):
  def scanned(a):
    return jax.lax.scan(lambda c, _: (jax.lax.psum(c, "tensor") * 0.5, None), a, None, length=5)[0]
  text = compiled(mesh, scanned, P("data", "tensor"), P("data", "tensor"), X)
  assert '"known_trip_count":{"n":"5"}' in text
  assert hlo.collectives(text, mesh) == [Collective("all-reduce", ("tensor",), 5, 5 * 128, True)]
  # Without XLA's annotation the count is read from the loop condition (a fused compare with constant 5).
  bare = re.sub(r", backend_config=\{[^\n]*\"known_trip_count\"[^\n]*\}", "", text)
  assert "known_trip_count" not in bare
  assert hlo.collectives(bare, mesh) == [Collective("all-reduce", ("tensor",), 5, 5 * 128, True)]


def test_loop_with_runtime_bound_counts_once(mesh):
  def dynamic(a, n):
    return jax.lax.fori_loop(0, n, lambda i, c: jax.lax.psum(c, "tensor") * 0.5, a)
  text = compiled(mesh, dynamic, (P("data", "tensor"), P()), P("data", "tensor"), X, 3)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert hlo.collectives(text, mesh) == [Collective("all-reduce", ("tensor",), 1, 128, True)]
  assert [w.category for w in caught] == [hlo.UnknownTripCountWarning]


def test_permute_gather_scatter_and_all_to_all(mesh):
  text = compiled(mesh, lambda a: jax.lax.ppermute(a, "data", [(0, 1), (1, 0)]), P("data", "tensor"),
                  P("data", "tensor"), X)
  assert hlo.collectives(text, mesh) == [Collective("collective-permute", ("data",), 1, 128, True)]
  text = compiled(mesh, lambda a: jax.lax.all_gather(a, "tensor", tiled=True), P("data", "tensor"), P("data"), X)
  assert hlo.collectives(text, mesh) == [Collective("all-gather", ("tensor",), 1, 4 * 128, True)]
  # CPU prints `reduce-scatter(%param)` without the operand's shape: the input is result x group size.
  text = compiled(mesh, lambda a: jax.lax.psum_scatter(a, "tensor", tiled=True), P("data"), P("data", "tensor"), X)
  assert hlo.collectives(text, mesh) == [Collective("reduce-scatter", ("tensor",), 1, 4 * 128, True)]
  text = compiled(mesh, lambda a: jax.lax.all_to_all(a, "tensor", 1, 0, tiled=True), P("data", "tensor"),
                  P("data", "tensor"), X)
  assert hlo.collectives(text, mesh) == [Collective("all-to-all", ("tensor",), 1, 128, True)]
