"""Plans: which output files exist and where each of their bytes comes from (plain data), and the
logical checkpoint state readers fill and writers turn into a plan (:mod:`.state`).

Import rule: ``formats`` and the vocabulary; nothing above.
"""
