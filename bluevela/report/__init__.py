"""Reports over the whole fleet, computed from what the run archive and the nightly store hold.

`fleet` gathers and computes (`bv report fleet`); `fleet_html` renders the page.
"""
