//! The pods an object will run, and the JSON Patch that places them: a Pod itself, a
//! `batch/v1` Job's template, a `kubeflow.org/v1` PyTorchJob's replica templates. The patch is
//! written against the object as received, so it applies whatever that object holds: a
//! missing `affinity`, `nodeAffinity` or `annotations` is added whole; an existing required
//! node affinity gets the product requirement added to each of its terms (terms are ORed, so
//! a term of its own would widen, not narrow, where the pod may go).

use serde_json::{json, Map, Value};

use crate::kubernetes::review::GroupVersionKind;

/// The node label GPU Feature Discovery writes with the card's product name.
pub const PRODUCT_LABEL: &str = "nvidia.com/gpu.product";

/// Most pod templates read from one object (a PyTorchJob has Master and Worker).
pub const MAX_TEMPLATES: usize = 8;

/// A pod (template) of the object: where it is, and what it says.
#[derive(Debug)]
pub struct Template<'a> {
    /// JSON Pointer of the pod (template) in the object: empty for a Pod.
    pub pointer: String,
    /// Where it is, for people: `the pod`, `spec.template`,
    /// `spec.pytorchReplicaSpecs.Worker.template`.
    pub label: String,
    /// The pod (template): its `metadata` and `spec`.
    pub pod: &'a Value,
}

impl Template<'_> {
    /// The annotation `key` of the pod (template); an error when it is there but not a string.
    pub fn annotation(&self, key: &str) -> Result<Option<&str>, String> {
        match self
            .pod
            .pointer(&format!("/metadata/annotations/{}", escape(key)))
        {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(_) => Err(format!(
                "{}: the annotation {key} must be a string",
                self.label
            )),
        }
    }
}

/// The pod templates of `object` of kind `kind`: none for a kind the webhook does not place.
pub fn templates<'a>(
    kind: &GroupVersionKind,
    object: &'a Value,
) -> Result<Vec<Template<'a>>, String> {
    let at = |pointer: &str, label: &str| {
        object.pointer(pointer).map(|pod| Template {
            pointer: pointer.to_string(),
            label: label.to_string(),
            pod,
        })
    };
    match (kind.group.as_str(), kind.kind.as_str()) {
        ("", "Pod") => Ok(vec![Template {
            pointer: String::new(),
            label: "the pod".to_string(),
            pod: object,
        }]),
        ("batch", "Job") => Ok(at("/spec/template", "spec.template").into_iter().collect()),
        ("kubeflow.org", "PyTorchJob") => {
            let Some(Value::Object(replicas)) = object.pointer("/spec/pytorchReplicaSpecs") else {
                return Ok(Vec::new());
            };
            if replicas.len() > MAX_TEMPLATES {
                return Err(format!(
                    "spec.pytorchReplicaSpecs: {} replica specs; at most {MAX_TEMPLATES} are read",
                    replicas.len()
                ));
            }
            Ok(replicas
                .keys()
                .filter_map(|name| {
                    at(
                        &format!("/spec/pytorchReplicaSpecs/{}/template", escape(name)),
                        &format!(
                            "spec.pytorchReplicaSpecs.{}.template",
                            crate::job::echo(name)
                        ),
                    )
                })
                .collect())
        }
        _ => Ok(Vec::new()),
    }
}

/// The operations that give `template` a required node affinity on `products` (kept with
/// whatever affinity it has) and the `annotations`.
pub fn placement_ops(
    template: &Template,
    products: &[String],
    annotations: Map<String, Value>,
) -> Vec<Value> {
    let mut ops = Vec::new();
    let requirement = json!({"key": PRODUCT_LABEL, "operator": "In", "values": products});
    let required = "requiredDuringSchedulingIgnoredDuringExecution";
    let terms = template
        .pod
        .pointer(&format!(
            "/spec/affinity/nodeAffinity/{required}/nodeSelectorTerms"
        ))
        .and_then(Value::as_array)
        .filter(|terms| !terms.is_empty());
    match terms {
        // Each term must also ask for the product: the terms are ORed, the expressions of a
        // term ANDed.
        Some(terms) => {
            for (index, term) in terms.iter().enumerate() {
                let path = format!(
                    "{}/spec/affinity/nodeAffinity/{required}/nodeSelectorTerms/{index}/matchExpressions",
                    template.pointer
                );
                if term.get("matchExpressions").is_some_and(Value::is_array) {
                    ops.push(
                        json!({"op": "add", "path": format!("{path}/-"), "value": requirement}),
                    );
                } else {
                    ops.push(json!({"op": "add", "path": path, "value": [requirement]}));
                }
            }
        }
        None => {
            let mut members = Map::new();
            members.insert(
                required.to_string(),
                json!({"nodeSelectorTerms": [{"matchExpressions": [requirement]}]}),
            );
            add_members(
                &mut ops,
                template,
                &["spec", "affinity", "nodeAffinity"],
                members,
            );
        }
    }
    add_members(
        &mut ops,
        template,
        &["metadata", "annotations"],
        annotations,
    );
    ops
}

/// Adds `members` to the object at `path` under the template, creating what is missing on
/// the way in one operation (two operations that each created the same parent would replace
/// each other's).
fn add_members(
    ops: &mut Vec<Value>,
    template: &Template,
    path: &[&str],
    members: Map<String, Value>,
) {
    let mut pointer = template.pointer.clone();
    let mut node = Some(template.pod);
    for (depth, segment) in path.iter().enumerate() {
        let next = node.and_then(|n| n.get(segment)).filter(|v| v.is_object());
        pointer = format!("{pointer}/{}", escape(segment));
        if next.is_none() {
            // The first missing level: added with everything below it.
            let mut value = Value::Object(members);
            for inner in path[depth + 1..].iter().rev() {
                value = json!({ *inner: value });
            }
            ops.push(json!({"op": "add", "path": pointer, "value": value}));
            return;
        }
        node = next;
    }
    for (key, value) in members {
        ops.push(
            json!({"op": "add", "path": format!("{pointer}/{}", escape(&key)), "value": value}),
        );
    }
}

/// A JSON Pointer reference token (RFC 6901): `~` as `~0`, `/` as `~1`.
pub fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: Value) -> Value {
        json!({"metadata": {"annotations": {"gpucast.dev/job": "{}"}}, "spec": spec})
    }

    fn ops_for(object: &Value) -> Vec<Value> {
        let kind = GroupVersionKind {
            group: String::new(),
            version: "v1".into(),
            kind: "Pod".into(),
        };
        let templates = templates(&kind, object).unwrap();
        let mut annotations = Map::new();
        annotations.insert("gpucast.dev/products".into(), "A,B".into());
        placement_ops(&templates[0], &["A".into(), "B".into()], annotations)
    }

    #[test]
    fn a_pod_without_affinity_gets_it_whole_and_its_annotation_beside_the_others() {
        let ops = ops_for(&pod(json!({"containers": []})));
        assert_eq!(ops[0]["path"], "/spec/affinity");
        assert_eq!(
            ops[0]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"][0]["matchExpressions"][0]["values"],
            json!(["A", "B"])
        );
        assert_eq!(
            ops[1]["path"],
            "/metadata/annotations/gpucast.dev~1products"
        );
    }

    #[test]
    fn existing_terms_each_get_the_requirement_and_other_affinity_is_kept() {
        let object = pod(json!({"affinity": {
        "podAntiAffinity": {"x": 1},
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
        ]}}}}));
        let ops = ops_for(&object);
        let base = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms";
        assert_eq!(ops[0]["path"], format!("{base}/0/matchExpressions/-"));
        assert_eq!(ops[1]["path"], format!("{base}/1/matchExpressions"));
        assert!(ops[1]["value"].is_array());
        assert_eq!(ops.len(), 3);
    }

    #[test]
    fn an_affinity_without_node_affinity_gets_one_added_beside_it() {
        let ops = ops_for(&pod(json!({"affinity": {"podAffinity": {}}})));
        assert_eq!(ops[0]["path"], "/spec/affinity/nodeAffinity");
        let ops = ops_for(&json!({"spec": {}}));
        assert_eq!(ops[1]["path"], "/metadata");
        assert_eq!(
            ops[1]["value"]["annotations"]["gpucast.dev/products"],
            "A,B"
        );
    }
}
