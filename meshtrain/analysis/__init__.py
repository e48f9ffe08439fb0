"""What a layout costs, from shapes alone or from the compiled program: the library behind `inspect`, `plan` and
`bench`.

  costs.py     helpers every task's cost model shares (abstract meshes, layer rows, pipeline shape, collectives)
  estimate.py  memory, FLOPs, collectives and step time of a layout, with the task's cost model for the rest
  hlo.py       collectives and dot FLOPs read from compiled HLO, loops counted
  perf.py      model FLOPs, GPU peaks and links, the measured CPU peak, the start-up clock
  plan.py      every layout of a cluster, ranked; verification by compiling the best
  inspect.py   a compiled step's memory, FLOPs and collectives against the estimate
  bench.py     step time, throughput, MFU and loop efficiency of a real run
"""
