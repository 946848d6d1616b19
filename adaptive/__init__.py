# tn.adaptive: the per-region eager/jit controller (issue "tn.adaptive"); installed as the subpackage tn.adaptive.
"""The adaptive controller: chooses eager or compiled execution per region of a model.

Not built yet: this package holds its place in the layout (``adaptive/`` maps
to ``tn.adaptive``). See the project's issue tracker for its design.
"""
