"""The CPU demo (`bash launch/demo.sh`): a tiny model, its warm start, its run config and what it
shows of a run.

    run.py         the demo's options, model and checkpoints, run config, progress lines
    warm_start.py  the supervised warm start on a task's format (tools/sft_warm_start.py)
    plot.py        a run's figure and summary table (`megatron-rl plot`)

The demo runs through a launcher it is given (launch/demo.py gives the local one): the launcher
imports the demo, never the reverse."""
