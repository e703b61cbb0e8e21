# Compiled by Cython in pure-Python mode (setup.py): h2_output.py is the source.
