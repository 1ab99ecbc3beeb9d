"""The cell simulation (`python -m inference_fleet simulate`, `make simulate-cell`): one cell's
instances, tasks and AWS services modelled in time, this package's own controllers deciding
(engine.py, on the things of world.py), scenario files (scenario.py), the modelled AWS behaviours with their sources
(model.py), invariants and report (runner.py). docs/simulation.md describes it."""
