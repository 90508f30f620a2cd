"""The Lockstep operator: `kopf run -m lockstep_operator` registers its handlers by importing it."""

from lockstep_operator import handlers as handlers
