"""A discrete-event simulator of the RL schedules (colocated / separated, synchronous / StaleSync).

  engine.py     the generation engine's slot scheduling without a model: counts per rollout phase
  workload.py   prompts, group size, response-length distributions (forced lengths reproduced exactly)
  costs.py      seconds from counts: per device group, generation / update / other phases
  schedules.py  the schedules over one or two device lanes -> per-step records, tokens/s, idle shares
  measure.py    what a measured run's workdir says (tokens/s, step time, idle, phase seconds)
  fit.py        cost parameters fitted to measured runs; a measured run's configuration re-simulated
  cluster.py    cost parameters at cluster scale from hardware and model figures (assumed, with sources)

Apart from the runtime: no module here imports JAX or a JAX program (tests/sim_test.py checks).
"""
