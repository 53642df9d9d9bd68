"""Running plans: the native executor into a staging folder, publishing it atomically, and the
agreement of several processes sharing one plan.

Import rule: ``planning``, ``formats`` and the vocabulary; no checkpoint format's rules.
"""
