"""The lab: replay workloads with and without speculation (`bench`) and certify exactness (`check`).

One concept per file: `workload` (JSONL requests), `make_workloads` (the shipped ones),
`arrivals` (closed and open loop), `backends` (in-process engine, OpenAI-compatible HTTP),
`metrics` (latency/throughput figures), `correctness` (greedy and distribution comparisons),
`runner` (bench orchestration), `results` (the results.json document), `report` (report.md,
assembled from `tables`, `policy_compare` and `plots`), `check` (the suite), `profile_plot` (a
hardware profile's step times).
"""
