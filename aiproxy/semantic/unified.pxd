# unified.py is compiled in Cython's pure-Python mode (setup.py: COMPILED_PY): the
# router extracts the text of every request it classifies.
