"""The cloud upstreams of CEILING_UPSTREAMS (core/upstreams.py): one class per transport, each an
implementation of the gateway's port (core/upstream.py Upstream) over api/upstream.py's pooled
client.

  bedrock.py  BedrockUpstream  Claude on Amazon Bedrock (InvokeModel, its stream), SigV4
  azure.py    AzureUpstream    Azure OpenAI's v1 API (chat, Responses, embeddings), `api-key`
  vertex.py   VertexUpstream   Vertex AI: Gemini and Claude, a service account's OAuth token

A call's plan names the model it sends in its body's `model` (the routing set it to Routed.
sent_model: an Azure deployment, a Bedrock model id); the cloud paths take it from there.
"""
