echo ready
