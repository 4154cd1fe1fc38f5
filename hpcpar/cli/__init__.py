"""`hpcpar <verb>`: the parser and one module per verb; library modules carry no `main`."""
