"""The ground floor: processes of this machine.

`lifeline` (a child dies with its parent), `groups` (start each process in its
own process group, stop it as a group), `procfs` (liveness and start time from
/proc), `ports` (free ports, open ports), `logs` (the tail of a process's log),
`umask` (the files of a run are its owner's alone), `holds` (a test stops a step at a
named point until it releases it).
Nothing here knows SkyRL-tx, a cluster or a run.
"""
