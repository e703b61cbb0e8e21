# Compiled by Cython in pure-Python mode (setup.py): h2_fast.py is the source.
