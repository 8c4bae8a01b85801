"""Routing's contract, below the PD core and the KV-event routing: what a policy reads (`policy.RoutingView`), what
it returns (`policy.Choice`), its interface (`policy.Policy`), and the policies that need no more than that."""
