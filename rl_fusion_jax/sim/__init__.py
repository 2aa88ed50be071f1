"""A discrete-event simulator of the RL schedules (colocated / separated, synchronous / StaleSync).

  engine.py     the generation engine's slot scheduling without a model: counts per rollout phase
  workload.py   prompts, group size, response-length distributions (forced lengths reproduced exactly)
  costs.py      seconds from counts: per device group, generation / update / other phases; processor
                sharing between the separated deployment's processes on one machine
  schedules.py  the schedules over one or two device lanes -> per-step records, tokens/s, idle shares
  measure.py    what a measured run's workdir says (tokens/s, step time, idle, phase seconds)
  fit.py        cost parameters fitted to measured runs; each run predicted held out (costs fitted on the
                other schedule's runs) and in-sample
  cluster.py    the cluster model: named inputs with their sources, costs of a step, and the effects that
                grow with the supernodes (tail barrier, all-reduce, weight publication, DistQueue, stragglers)
  tables.py     Tables 1 and 2 at cluster scale, the sweep, and the validation's tables

Apart from the runtime: no module here imports JAX or a JAX program (tests/sim_test.py checks).
"""
