"""``aiakrun --advise``: measure the job, predict the step time of each configuration.

* :mod:`.model`: the step-time model (all formulas and constants);
* :mod:`.whatif`: parsing ``--what-if``;
* :mod:`.link_measure`: the link measurement job;
* :mod:`.trace`: the hook that profiles the user's script;
* :mod:`.report`: the table.
"""
