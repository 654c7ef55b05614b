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

/// Most terms of a template's required node affinity. Each term the product requirement is
/// added to costs one patch operation listing every fitting product, so the terms bound the
/// answer; real pods carry a handful (Kubernetes sets no limit of its own).
pub const MAX_NODE_SELECTOR_TERMS: usize = 64;

/// Most requirements (`matchExpressions` and `matchFields`) over all of a template's terms.
pub const MAX_NODE_SELECTOR_REQUIREMENTS: usize = 512;

/// Most containers of a template (`containers`, `initContainers` and `ephemeralContainers`).
pub const MAX_CONTAINERS: usize = 64;

/// Most bytes of a template's annotations, keys and values: the API server's own limit.
pub const MAX_ANNOTATION_BYTES: usize = 256 * 1024;

/// Most bytes of the JSON Patch written for one object, before base64 (the answer then stays
/// under 1 MB).
pub const MAX_PATCH_BYTES: usize = 512 * 1024;

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

/// The required node affinity's terms of a pod (template), when it has any.
fn node_selector_terms(pod: &Value) -> Option<&Vec<Value>> {
    pod.pointer(
        "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms",
    )
    .and_then(Value::as_array)
}

/// Whether a node selector term selects anything: Kubernetes reads a term without
/// requirements as matching no node, so it is left as it is (the product requirement added to
/// it would make it match, widening where the pod may go).
fn selects(term: &Value) -> bool {
    ["matchExpressions", "matchFields"].iter().any(|key| {
        term.get(key)
            .and_then(Value::as_array)
            .is_some_and(|requirements| !requirements.is_empty())
    })
}

/// The price of a pod (template), checked before any work is done for it: its containers,
/// its node affinity's terms and their requirements, its annotations' bytes. Each is counted
/// in one pass over what arrived (no copy), and a template over any limit is refused, so what
/// the webhook writes back stays bounded by what it was sent.
pub fn price(template: &Template) -> Result<(), String> {
    let label = &template.label;
    let spec = template.pod.get("spec");
    let containers: usize = ["containers", "initContainers", "ephemeralContainers"]
        .iter()
        .filter_map(|key| spec.and_then(|s| s.get(key)).and_then(Value::as_array))
        .map(Vec::len)
        .sum();
    if containers > MAX_CONTAINERS {
        return Err(format!(
            "{label}: {containers} containers; at most {MAX_CONTAINERS} are read"
        ));
    }
    if let Some(terms) = node_selector_terms(template.pod) {
        if terms.len() > MAX_NODE_SELECTOR_TERMS {
            return Err(format!(
                "{label}: {} node selector terms in the required node affinity; at most \
                 {MAX_NODE_SELECTOR_TERMS} are read",
                terms.len()
            ));
        }
        let requirements: usize = terms
            .iter()
            .flat_map(|term| ["matchExpressions", "matchFields"].map(|key| term.get(key)))
            .filter_map(|list| list.and_then(Value::as_array))
            .map(Vec::len)
            .sum();
        if requirements > MAX_NODE_SELECTOR_REQUIREMENTS {
            return Err(format!(
                "{label}: {requirements} node selector requirements in the required node \
                 affinity; at most {MAX_NODE_SELECTOR_REQUIREMENTS} are read"
            ));
        }
    }
    if let Some(Value::Object(annotations)) = template.pod.pointer("/metadata/annotations") {
        let bytes: usize = annotations
            .iter()
            .map(|(key, value)| key.len() + value.as_str().map_or(0, str::len))
            .sum();
        if bytes > MAX_ANNOTATION_BYTES {
            return Err(format!(
                "{label}: {bytes} bytes of annotations; at most {MAX_ANNOTATION_BYTES} are read"
            ));
        }
    }
    Ok(())
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
    let known = match (kind.group.as_str(), kind.kind.as_str()) {
        ("", "Pod") => Some("v1"),
        ("batch", "Job") => Some("batch/v1"),
        ("kubeflow.org", "PyTorchJob") => Some("kubeflow.org/v1"),
        _ => None,
    };
    if let Some(expected) = known {
        check_version(kind, object, expected)?;
    }
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

/// A kind the webhook places is read only at the version it knows (`expected`, as the
/// object's `apiVersion` says it): the review's `kind.version` and the object's own
/// `apiVersion`, when it has one, must both be it.
fn check_version(kind: &GroupVersionKind, object: &Value, expected: &str) -> Result<(), String> {
    let reviewed = if kind.group.is_empty() {
        kind.version.clone()
    } else {
        format!("{}/{}", kind.group, kind.version)
    };
    if reviewed != expected {
        return Err(format!(
            "request.kind: {} {} is not read; the webhook places {} {expected}",
            crate::job::echo(&reviewed),
            crate::job::echo(&kind.kind),
            crate::job::echo(&kind.kind)
        ));
    }
    match object.get("apiVersion") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(declared)) if declared == expected => Ok(()),
        Some(declared) => Err(format!(
            "request.object.apiVersion: {} does not match request.kind ({expected})",
            crate::job::echo(&declared.to_string())
        )),
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
    let terms = node_selector_terms(template.pod).filter(|terms| !terms.is_empty());
    match terms {
        // Each term must also ask for the product: the terms are ORed, the expressions of a
        // term ANDed. A term that selects nothing is left so ([`selects`]).
        Some(terms) => {
            // A term that asks for these products already (a pod of a placed template) is
            // left as it is.
            let placed = |term: &Value| {
                term.get("matchExpressions")
                    .and_then(Value::as_array)
                    .is_some_and(|list| list.contains(&requirement))
            };
            for (index, term) in terms
                .iter()
                .enumerate()
                .filter(|(_, t)| selects(t) && !placed(t))
            {
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
    // Only the annotations that change: a pod of a placed template carries them already.
    let annotations: Map<String, Value> = annotations
        .into_iter()
        .filter(|(key, value)| template.annotation(key).ok().flatten() != value.as_str())
        .collect();
    if !annotations.is_empty() {
        add_members(
            &mut ops,
            template,
            &["metadata", "annotations"],
            annotations,
        );
    }
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

/// The GPUs the object asks for in all: each pod template's `nvidia.com/gpu` limits (its
/// containers' summed) times its replicas (a Job's `parallelism`, a PyTorchJob replica spec's
/// `replicas`; 1 when unsaid). `None` when no template asks for a GPU. What a distributed
/// job's world size is when its annotation does not say.
pub fn requested_gpus(kind: &GroupVersionKind, object: &Value) -> Option<u64> {
    let per_pod = |pod: &Value| -> u64 {
        pod.pointer("/spec/containers")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|c| c.pointer("/resources/limits/nvidia.com~1gpu"))
            .filter_map(|n| match n {
                Value::Number(n) => n.as_u64(),
                Value::String(s) => s.trim().parse().ok(),
                _ => None,
            })
            .fold(0u64, u64::saturating_add)
    };
    let count = |value: Option<&Value>| value.and_then(Value::as_u64).unwrap_or(1);
    let total = match (kind.group.as_str(), kind.kind.as_str()) {
        ("", "Pod") => per_pod(object),
        ("batch", "Job") => object.pointer("/spec/template").map_or(0, |pod| {
            per_pod(pod).saturating_mul(count(object.pointer("/spec/parallelism")))
        }),
        ("kubeflow.org", "PyTorchJob") => object
            .pointer("/spec/pytorchReplicaSpecs")
            .and_then(Value::as_object)
            .into_iter()
            .flat_map(|specs| specs.values().take(MAX_TEMPLATES))
            .map(|spec| {
                spec.get("template")
                    .map_or(0, per_pod)
                    .saturating_mul(count(spec.get("replicas")))
            })
            .fold(0u64, u64::saturating_add),
        _ => 0,
    };
    (total > 0).then_some(total)
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
    fn a_term_that_selects_nothing_is_left_so_and_too_many_terms_are_refused() {
        let object = pod(json!({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {}, {"matchExpressions": []},
            {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}
        ]}}}}));
        let ops = ops_for(&object);
        assert_eq!(ops.len(), 2, "{ops:#?}");
        assert!(ops[0]["path"]
            .as_str()
            .unwrap()
            .ends_with("nodeSelectorTerms/2/matchExpressions/-"));
        let flood = pod(json!({"affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": vec![json!({}); MAX_NODE_SELECTOR_TERMS + 1]}}}}));
        let kind = GroupVersionKind {
            group: String::new(),
            version: "v1".into(),
            kind: "Pod".into(),
        };
        let flooded = templates(&kind, &flood).unwrap();
        assert!(price(&flooded[0])
            .unwrap_err()
            .contains("node selector terms"));
        let object = pod(json!({"containers": []}));
        assert!(price(&templates(&kind, &object).unwrap()[0]).is_ok());
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
