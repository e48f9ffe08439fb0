"""Mesh construction: sizes, -1 filling, and the hybrid mesh over real processes (jax.distributed, gloo)."""
import socket
import subprocess
import sys
import textwrap

import jax
import pytest

from meshtrain import mesh as mesh_lib
from meshtrain.errors import UserError


def test_sizes_and_fill():
  m = mesh_lib.make_mesh({"fsdp": -1, "tensor": 2})
  assert dict(m.shape) == {"stage": 1, "data": 1, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
  assert mesh_lib.fill_sizes({"data": -1}, 8, "mesh") == {"stage": 1, "data": 8, "fsdp": 1, "expert": 1,
                                                          "sequence": 1, "tensor": 1}
  with pytest.raises(UserError, match="multiply to 6, but there are 8 devices"):
    mesh_lib.make_mesh({"data": 3, "tensor": 2})


def test_tensor_groups_are_neighbours():
  m = mesh_lib.make_mesh({"data": 4, "tensor": 2})
  ids = [[d.id for d in row] for row in m.devices.reshape(4, 2)]
  assert ids == [[0, 1], [2, 3], [4, 5], [6, 7]]


HYBRID = textwrap.dedent("""
    import sys, jax
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    from meshtrain import mesh
    m = mesh.make_mesh({"data": 1, "fsdp": 2, "tensor": 2})  # per node; mesh.nodes.data fills the 2 nodes
    print({k: v for k, v in m.shape.items() if v > 1},
          [[d.process_index for d in row] for row in m.devices.reshape(2, 4)])
    try:
      mesh.make_mesh({"fsdp": 4, "nodes": {"data": 1}})
    except mesh.UserError as e:
      print("error:", e)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      m = mesh.make_mesh({"fsdp": 4, "nodes": {"data": 1, "tensor": 2}})  # tensor on the slow links
    print(dict(m.shape)["tensor"], "warned:", " | ".join(str(w.message) for w in caught))
""")


def test_hybrid_mesh_puts_data_axis_across_processes(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  script = tmp_path / "hybrid.py"
  script.write_text(HYBRID)
  procs = [subprocess.Popen([sys.executable, str(script), address, str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
    # data=2 spans the processes; fsdp x tensor stay inside each process (the fast links).
    assert "{'data': 2, 'fsdp': 2, 'tensor': 2} [[0, 0, 0, 0], [1, 1, 1, 1]]" in out
    assert "mesh.nodes (2 nodes): axis sizes data=1 multiply to 1, but there are 2 nodes" in out
    assert "2 warned: mesh.nodes puts tensor=2 across nodes" in out and "keep tensor inside a node" in out
