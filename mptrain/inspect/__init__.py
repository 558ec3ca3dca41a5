"""Reading the compiled step: `program` (XLA's text as kernels and buffers), `hlo` (collectives,
attention, hazards found in it) and `audit` (the precision report: each matmul's dtypes, what is
kept fp32). It may import `recipe` and the base modules; `record`, `train` and `plan` read it.
"""
