"""Plans: which output files exist and where each of their bytes comes from (plain data)."""
