"""`hpcpar plan`: a cost model of hpcpar (hardware, prediction, search) that picks the layout."""
