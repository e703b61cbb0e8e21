# Compiled by Cython in pure-Python mode (setup.py): h2_server.py is the source.
