"""Load runs: flood each strategy with Locust, audit it, record a SaleRun, write the report.

- `config`: `LoadRunSettings`, what a batch is asked to do, and where it tells how it goes;
- `batch`: the orchestration: the server and its worker, the baseline, then each strategy's
  probe, sale and drain, in turn or in rounds;
- `locust_driver`: runs Locust for one run and reads the files it writes;
- `window`: a sale's measured window, and the rates and CPU over it;
- `recording`: the SaleRun rows: the sale's audit, its settle lag, who ran it, and the runs a
  killed process left behind.

See docs/load-runs.md.
"""
