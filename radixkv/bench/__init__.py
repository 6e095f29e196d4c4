"""The measuring behind ``radixkv bench`` and ``radixkv demo``: tooling, not library.

It ships in the package because ``radixkv bench`` is a documented command of an installed
radixkv (measure your own model, settings or server); it sits beside ``cli.py``, above every
library layer, and no library module imports it (tests/test_engine_bench_cli.py checks).
The benchmarks that compare radixkv with other systems live in the source checkout's bench/.

* ``workloads``: seeded token prompts that share prefixes as real traffic does;
* ``measure``: one engine run measured (hit rate, TTFT, throughput, prefill saved) and a table;
* ``offline``: ``radixkv bench`` on an engine here, prefix cache off vs on;
* ``serving``: ``radixkv bench --base-url``, the same workloads sent to running servers;
* ``cli``: the command's parser and entry point.
"""
