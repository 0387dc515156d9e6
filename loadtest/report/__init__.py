"""The comparison of a batch of load runs: a table for the terminal, CSV, JSON and HTML.

- `columns`: what each column of the comparison (and of the CPU table) shows, and the notes
  under it;
- `ratios`: each strategy's units/s against `lock`'s and the baseline's, and the medians of
  several rounds;
- `text`: the tables as fixed-width text, for the terminal;
- `charts`: the charts as inline SVG, for the HTML report and the admin's compare page;
- `files`: runs.csv, runs.json and report.html.

See docs/load-runs.md#the-comparison.
"""
