"""A new accountant in one file: Rényi DP at the integer orders 2..64 only.

This is the moments accountant of Abadi et al. (2016), the figure older papers report; the
registered ``rdp`` accountant uses dp_accounting's finer order grid and is never looser at the
orders both share. Importing this module registers it, after which ``accountant="rdp_integer"``
works everywhere an accountant is named: ``TrainConfig``, the ledger, calibration,
:func:`userdp.accounting.epsilon`, and with no edit to userdp the command line:

    userdp train config.yaml --plugin examples/plugins/integer_rdp.py --set privacy.accountant=rdp_integer
    userdp account --plugin examples/plugins/integer_rdp.py --accountant rdp_integer ...
"""

from __future__ import annotations

from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from userdp import accounting

ORDERS = tuple(float(a) for a in range(2, 65))


class IntegerOrderRDP:
    """RDP restricted to integer orders (see the module docstring)."""

    name = "rdp_integer"
    discretized = False

    def epsilon(self, event, delta, *, interval=None, orders=None):
        rdp = accounting.step_rdp(event, ORDERS)  # RDP of the (composed) event at each order
        return float(rdp_lib.compute_epsilon(ORDERS, rdp, delta)[0]), self.name

    def delta(self, event, epsilon, *, interval=None, orders=None):
        return float(rdp_lib.compute_delta(ORDERS, accounting.step_rdp(event, ORDERS), epsilon)[0])

    def epsilon_of_steps(self, step_event, steps, delta):
        return float(rdp_lib.compute_epsilon(ORDERS, steps * accounting.step_rdp(step_event, ORDERS), delta)[0])


if IntegerOrderRDP.name not in accounting.ACCOUNTANTS:
    accounting.register_accountant(IntegerOrderRDP())
