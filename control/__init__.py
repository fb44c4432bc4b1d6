"""Operator and developer tooling, above the three processes.

The `payhook` command (`cli`), the dashboard, alerts, retention, migrations and
the checks of unique rules on live tables, the dead-letter and quarantine
commands, `payhook up` (`stack`) and `payhook send` (`sender`). It may import
the kernel (`payhook`) and start the processes (`ingress`, `consumer`,
`outbox_worker`); none of those imports it.
"""
