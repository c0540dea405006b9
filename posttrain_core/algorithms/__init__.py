"""Algorithms as pure tensor functions, registered by name, with the formula and the shapes in each docstring.

Imports only torch. `preference`: Bradley-Terry reward-model loss, DPO/IPO/cDPO, summed sequence log-probs.
"""
