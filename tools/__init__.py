"""The tools: planning, benchmarking and drawing, apart from what trains.

    bench.py        the training step of any config and layout timed (tokens/s, MFU, memory, waits)
    make_config.py  a commented starter config for a model size and layout, checked, with its plan
    step_time.py    one step's time predicted before anything runs
    machines.py     the machines step_time.py knows, or this one measured
    memory_plan.py  each rank's memory predicted from the config and the layout
    timeline.py     the pipeline schedules drawn in time, from the action lists the executor runs
    plot.py         loss, learning rate, grad norm and tokens/s of runs, as a PNG

Each runs as `python tools/NAME.py` (torchrun for bench.py). Training never needs this folder:
train.py imports the planners when they are here (its start-up plan and predicted step, pp_trace)
and says what it skipped when they are not. The tools import the training code, never the other way
round.
"""
