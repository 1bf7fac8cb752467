"""The SLA planner (``pdserve planner``): sets how many engine workers hold each role."""
