"""kvsum's benchmarks: named experiments (benchmarks/experiments/) and the runners that reproduce them.

    python -m benchmarks list           # every experiment, one line each
    python -m benchmarks run NAME       # rerun one; writes benchmarks/results/<family>/<name>.json and .md
    python -m benchmarks run headline   # the README's frontier table, from the committed results alone
"""
