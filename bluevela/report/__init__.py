"""Every HTML page of bluevela, and the analysis behind each.

Analyses return plain data and import without matplotlib: `fleet` (`bv report fleet`),
`efficiency` (a job's efficiency and stragglers), `nightly` (a night's series and flagged
nodes). Pages lay them out: `fleet_html`, `efficiency_html`, `nightly_html`, all built on
`page` (stylesheet, escaping, formatting, the atomic no-follow writer, matplotlib charts).
"""
