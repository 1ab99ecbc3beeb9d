"""The first-deploy acceptance kit: `python -m inference_fleet verify --config fleet.yaml --cell NAME`.

It turns what the docs call "verified only on paper" into a measured pass, fail or not run on
a real cell (docs/verifying.md). Parts: `claims` (each check and the doc sentence it settles),
`report` (the JSON and Markdown reports), `adapter` (how the kit reaches a cell: the protocol
and its data), `aws` (a deployed cell, boto3) and `local` (the CPU unit of `make e2e`,
processes and log files), `serving_client` (the requests, by front end: `openai_http` for vLLM's
OpenAI API, `triton_http` for Triton's KServe v2 generate, over `http_base`), `checks_serving`
(checks 1-3), `checks_cell` (4-6), `checks_faults` (7, `--destructive`), `runner` (runs them in
order) and `cli` (the command).
"""
